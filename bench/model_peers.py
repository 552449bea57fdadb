#!/usr/bin/env python3
"""The Python side of BENCHMARKS.md "Real models on CPU producers": the same exported model
(examples/export_model.py, .pt) over the same number of images, as its users run it:

- the loop with all of torch's threads (torch.jit.load, model(x) per item);
- a torch.multiprocessing Pool of --workers processes, each loading the model in its
  initializer, with torch.set_num_threads(1) there (PyTorch's advice for a pool) and without it
  (each worker with every core's threads, as a script that does not know the advice runs);
- easycore 0.4.2's OrderedRunner (the seed) with --workers CPU workers, one thread each, when
  it is importable (bench/model_peers.sh installs it beside the torch venv).

Every configuration's outputs equal the loop's (checked). Images/s, the best of --repeat runs.

usage: model_peers.py MODEL.pt [--inputs 3072] [--images 512] [--per-item 1] [--workers 2]
"""
import argparse
import time
import warnings

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

_model = None


def _init(path, threads):
    global _model
    if threads:
        torch.set_num_threads(threads)
    _model = torch.jit.load(path)
    _model.eval()
    with torch.inference_mode():
        _model(torch.zeros(1, _model_inputs(path)))


def _model_inputs(path):
    with open(path + ".ref.txt") as f:
        return len(f.readline().split(";")[0].split())


def _work(x):
    with torch.inference_mode():
        return _model(x)


def best_of(repeat, run):
    best, out = float("inf"), None
    for r in range(repeat + 1):  # run 0 warms up
        start = time.perf_counter()
        out = run()
        if r > 0:
            best = min(best, time.perf_counter() - start)
    return best, out


def check(out, expected, what):
    assert len(out) == len(expected), what
    for a, b in zip(out, expected):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-4), what + ": an output differs"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--images", type=int, default=512)
    ap.add_argument("--per-item", type=int, default=1)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    inputs = _model_inputs(a.model)
    torch.manual_seed(1)
    items = [torch.randn(a.per_item, inputs) for _ in range(a.images // a.per_item)]
    n = len(items) * a.per_item
    model = torch.jit.load(a.model)
    model.eval()

    def loop():
        with torch.inference_mode():
            return [model(x) for x in items]

    t, expected = best_of(a.repeat, loop)
    print(f"{a.model}: {len(items)} items of {a.per_item} image(s), {a.workers} workers")
    print(f"{'Python loop, ' + str(torch.get_num_threads()) + ' threads':44s} {n / t:10.1f} images/s")
    ctx = mp.get_context("spawn")
    for threads, name in ((1, "1 thread each"), (0, "default threads")):
        with ctx.Pool(a.workers, initializer=_init, initargs=(a.model, threads)) as pool:
            t, out = best_of(a.repeat, lambda: pool.map(_work, items, chunksize=1))
        check(out, expected, "pool")
        print(f"{'torch.multiprocessing Pool, ' + name:44s} {n / t:10.1f} images/s")
    try:
        from easycore.common.parallel import OrderedRunner
    except ImportError:
        print("easycore: not installed (bench/model_peers.sh)")
        return

    class Classify(OrderedRunner):
        @staticmethod
        def producer_init(device, cfg):
            torch.set_num_threads(1)
            cfg.model = torch.jit.load(cfg.path)
            cfg.model.eval()

        @staticmethod
        def producer_work(device, cfg, data):
            with torch.inference_mode():
                return cfg.model(data)

        @staticmethod
        def producer_end(device, cfg):
            pass

        @staticmethod
        def consumer_init(cfg):
            cfg.out = []

        @staticmethod
        def consumer_work(cfg, data):
            cfg.out.append(data)

        @staticmethod
        def consumer_end(cfg):
            return cfg.out

    from easycore.common.config import CfgNode

    cfg = CfgNode()
    cfg.path = a.model
    runner = Classify(["cpu"] * a.workers, cfg=cfg)
    t, out = best_of(a.repeat, lambda: runner(items))
    runner.close()
    check(out, expected, "easycore")
    print(f"{'easycore OrderedRunner, 1 thread each':44s} {n / t:10.1f} images/s")


if __name__ == "__main__":
    main()
