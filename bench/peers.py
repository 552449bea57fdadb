#!/usr/bin/env python3
"""Side-by-side table: troupe (bench/troupe_bench), the seed easycore 0.4.2 and Ray's ActorPool
on the same trivial work (x*x summed, 2 workers) in one run. Peers are installed by
bench/peers.sh into their own virtual environment; troupe never depends on them.

usage: peers.py TROUPE_BENCH [--items N] [--peer-items M]
"""
import argparse
import re
import subprocess
import time


def run_troupe(binary, items):
    out = subprocess.run([binary, "--items", str(items), "--repeat", "3"], check=True,
                         capture_output=True, text=True).stdout
    troupe = float(re.search(r"troupe unordered_runner : ([0-9.]+)", out).group(1)) * 1e6
    threads = float(re.search(r"std::thread pipeline    : ([0-9.]+)", out).group(1)) * 1e6
    return troupe, threads


def run_easycore(items):
    from easycore.common.parallel import UnorderedRunner

    class Squares(UnorderedRunner):
        @staticmethod
        def producer_work(device, cfg, data):
            return data * data

        @staticmethod
        def consumer_init(cfg):
            cfg.total = 0

        @staticmethod
        def consumer_work(cfg, data):
            cfg.total += data

        @staticmethod
        def consumer_end(cfg):
            return cfg.total

    runner = Squares(2)
    start = time.perf_counter()
    total = runner(range(items))
    elapsed = time.perf_counter() - start
    runner.close()
    assert total == sum(x * x for x in range(items)), total
    return items / elapsed


def run_ray(items):
    import ray
    from ray.util import ActorPool

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)

    @ray.remote
    class Squarer:
        def work(self, x):
            return x * x

    actors = [Squarer.remote() for _ in range(2)]
    ray.get([a.work.remote(0) for a in actors])  # actors started before timing
    pool = ActorPool(actors)
    start = time.perf_counter()
    total = sum(pool.map_unordered(lambda a, x: a.work.remote(x), range(items)))
    elapsed = time.perf_counter() - start
    ray.shutdown()
    assert total == sum(x * x for x in range(items)), total
    return items / elapsed


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("troupe_bench")
    parser.add_argument("--items", type=int, default=2_000_000)
    parser.add_argument("--peer-items", type=int, default=20_000)
    args = parser.parse_args()
    troupe, threads = run_troupe(args.troupe_bench, args.items)
    rows = [("troupe unordered_runner (C++)", args.items, troupe),
            ("hand-written std::thread pipeline (C++)", args.items, threads),
            ("easycore 0.4.2 UnorderedRunner (Python)", args.peer_items, run_easycore(args.peer_items)),
            ("Ray ActorPool.map_unordered (Python)", args.peer_items, run_ray(args.peer_items))]
    print("| runner | items | items/s | troupe is |")
    print("|---|---|---|---|")
    for name, n, rate in rows:
        print(f"| {name} | {n:,} | {rate:,.0f} | {troupe / rate:,.1f}x |")


if __name__ == "__main__":
    main()
