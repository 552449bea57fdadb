"""Ray Serve peer of `examples/serve`: POST /predict, 16 comma-separated numbers in the body,
answer {"class": K, "score": S}, written with the Ray Serve docs' @serve.batch idiom.

The model call is simulated as troupe's `serve --call-us 2000 --item-us 100`: an async sleep of
2 ms per call + 0.1 ms per request in the batch; then a fixed 10x16 linear classifier. With
--model FILE.pt (examples/export_model.py) it is that TorchScript model instead, loaded with
torch.jit.load in each of --replicas replicas (one CPU and --threads intra-op threads each, as
Ray's docs suggest for CPU models), requests of --inputs numbers.

Run it with bench/peers_serve/run_ray.sh (or: python ray_app.py --port 8000). The deployment
object is `app`, so `serve run bench.peers_serve.ray_app:app` works as well.
"""
import argparse
import asyncio
import os
import signal
import threading
from typing import List

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# Keep every Ray process on loopback: Ray otherwise picks the node's outward address for its own
# gRPC traffic even for a one-machine instance (on Linux it ignores _node_ip_address="127.0.0.1"
# and resolves it back). With "clusters" off it uses 127.0.0.1, as it does on macOS.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import numpy as np
from ray import serve
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse

N_FEATURES, N_CLASSES = 16, 10


def parse_features(body: bytes, n: int = N_FEATURES):
    """"0.1,0.2,..." or "[0.1, 0.2, ...]": n floats, or None."""
    text = body.decode("utf-8", "replace").strip().strip("[]")
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        return None
    if len(values) != n or not all(np.isfinite(values)):
        return None
    return np.asarray(values, dtype=np.float32)


@serve.deployment(
    num_replicas=1,
    # A 2-core machine: one core for the replica; the HTTP proxy and controller take none.
    ray_actor_options={"num_cpus": 1},
    # Default is 5, which would cap every batch at 5: the batching guide says to raise it above
    # max_batch_size. 64 = the most connections the benchmark opens.
    max_ongoing_requests=64,
)
class Classifier:
    def __init__(self, model: str = "", inputs: int = N_FEATURES, threads: int = 1):
        rng = np.random.default_rng(42)
        self.weights = rng.standard_normal((N_CLASSES, N_FEATURES)).astype(np.float32)
        self.inputs = inputs
        self.model = None
        if model:
            import torch

            torch.set_num_threads(threads)
            self.torch = torch
            self.model = torch.jit.load(model)
            self.model.eval()

    @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.002)
    async def predict(self, rows: List[np.ndarray]) -> List[dict]:
        if self.model is not None:
            with self.torch.inference_mode():
                scores = self.model(self.torch.from_numpy(np.stack(rows))).numpy()
        else:
            await asyncio.sleep(0.002 + 0.0001 * len(rows))  # the model call, as an async model
            scores = np.stack(rows) @ self.weights.T  # [batch, 10]
        labels = scores.argmax(axis=1)
        return [
            {"class": int(k), "score": float(s[k])} for k, s in zip(labels, scores)
        ]

    async def __call__(self, request: Request):
        if request.method != "POST":
            return PlainTextResponse("POST only\n", status_code=405)
        x = parse_features(await request.body(), self.inputs)
        if x is None:
            return PlainTextResponse(f"expected {self.inputs} numbers\n", status_code=400)
        return JSONResponse(await self.predict(x))


app = Classifier.bind()  # the simulated model: `serve run bench.peers_serve.ray_app:app`


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--num-cpus", type=int, default=2)
    parser.add_argument("--model", default="", help="a TorchScript file instead of the sleep")
    parser.add_argument("--inputs", type=int, default=N_FEATURES, help="numbers per request")
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per replica")
    args = parser.parse_args()

    import ray

    # A local Ray instance whose processes share this process's fate: stopping this process
    # (SIGINT/SIGTERM) shuts Serve and Ray down.
    ray.init(
        num_cpus=args.num_cpus,
        include_dashboard=False,
        log_to_driver=False,
    )
    serve.start(http_options={"host": args.host, "port": args.port})
    deployment = Classifier.options(num_replicas=args.replicas)
    serve.run(deployment.bind(args.model, args.inputs, args.threads), route_prefix="/predict")
    print(f"ray serve on http://{args.host}:{args.port}/predict", flush=True)

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
