"""PyTriton peer of `examples/serve`: a Python model bound to NVIDIA Triton with dynamic batching.

The model call is simulated as troupe's `serve --call-us 2000 --item-us 100`: time.sleep(2 ms +
0.1 ms per request in the batch), then a fixed 10x16 linear classifier. Triton's dynamic batcher
gathers up to 8 requests and waits at most 2 ms.

HTTP is Triton's KServe v2 JSON protocol (hit it with post_v2.lua):
  POST /v2/models/classifier/infer
  {"inputs":[{"name":"x","shape":[1,16],"datatype":"FP32","data":[0.1,...,1.6]}]}
  -> {"outputs":[{"name":"class",...,"data":[K]},{"name":"score",...,"data":[S]}], ...}

  python pytriton_app.py --port 8000     (stop it with SIGINT or SIGTERM)

With --model FILE.pt (examples/export_model.py) the model is that TorchScript file instead,
loaded with torch.jit.load in each of --instances model instances (PyTriton runs each in a
thread of its own; torch's intra-op threads: --threads in all), requests of --inputs numbers.
"""
import argparse
import logging
import time

import numpy as np
from pytriton.decorators import batch
from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
from pytriton.triton import Triton, TritonConfig

N_FEATURES, N_CLASSES = 16, 10
WEIGHTS = np.random.default_rng(42).standard_normal((N_CLASSES, N_FEATURES)).astype(np.float32)


@batch
def infer(x: np.ndarray):
    """x: [batch, 16] FP32 -> class [batch, 1] INT64, score [batch, 1] FP32."""
    time.sleep(0.002 + 0.0001 * x.shape[0])  # the model call
    scores = x @ WEIGHTS.T
    labels = scores.argmax(axis=1)
    best = scores[np.arange(len(labels)), labels]
    return {"class": labels.astype(np.int64)[:, None], "score": best.astype(np.float32)[:, None]}


def torch_infer(path: str):
    """An infer function of its own TorchScript module (one per model instance)."""
    import torch

    module = torch.jit.load(path)
    module.eval()

    @batch
    def run(x: np.ndarray):
        with torch.inference_mode():
            scores = module(torch.from_numpy(x)).numpy()
        labels = scores.argmax(axis=1)
        best = scores[np.arange(len(labels)), labels]
        return {"class": labels.astype(np.int64)[:, None],
                "score": best.astype(np.float32)[:, None]}

    return run


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port")
    parser.add_argument("--grpc-port", type=int, default=0, help="0: HTTP port + 1")
    parser.add_argument("--metrics-port", type=int, default=0, help="0: HTTP port + 2")
    parser.add_argument("--model", default="", help="a TorchScript file instead of the sleep")
    parser.add_argument("--inputs", type=int, default=N_FEATURES, help="numbers per request")
    parser.add_argument("--instances", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    funcs = infer
    if args.model:
        import torch

        torch.set_num_threads(args.threads)
        funcs = [torch_infer(args.model) for _ in range(args.instances)]

    config = TritonConfig(
        http_address=args.host,
        http_port=args.port,
        grpc_address=args.host,
        grpc_port=args.grpc_port or args.port + 1,
        metrics_address=args.host,
        metrics_port=args.metrics_port or args.port + 2,
        allow_gpu_metrics=False,
    )
    with Triton(config=config) as triton:
        triton.bind(
            model_name="classifier",
            infer_func=funcs,
            inputs=[Tensor(name="x", dtype=np.float32, shape=(args.inputs,))],
            outputs=[
                Tensor(name="class", dtype=np.int64, shape=(1,)),
                Tensor(name="score", dtype=np.float32, shape=(1,)),
            ],
            config=ModelConfig(
                max_batch_size=8,
                batcher=DynamicBatcher(max_queue_delay_microseconds=2000),
            ),
            strict=True,
        )
        print(f"pytriton serving on http://{args.host}:{args.port}/v2/models/classifier/infer",
              flush=True)
        triton.serve()  # blocks until SIGINT/SIGTERM


if __name__ == "__main__":
    main()
