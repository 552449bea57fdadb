#!/usr/bin/env python3
"""Baseline side of troupe's training benchmark: plain PyTorch (torch.distributed, gloo, CPU).

Run it with the LibTorch virtual environment's Python. Every mode spawns N worker processes
(torch.multiprocessing, start method "spawn") that join one gloo process group initialised via
tcp://127.0.0.1:<free port>; all traffic stays on the loopback interface.

  allreduce: per size, a float32 tensor of M MiB, 3 warm-up all_reduce calls, then K timed
             dist.all_reduce calls (barrier first; each call timed on rank 0 with
             time.perf_counter). Rank 0 prints one line per size:
               gloo allreduce procs=N mib=M median_ms=X mean_ms=Y algbw_gbs=Z
             with algbw = M MiB in bytes / median seconds / 1e9.

  ddp:       MLP Linear(features, hidden) -> ReLU -> Linear(hidden, hidden) -> ReLU ->
             Linear(hidden, classes) wrapped in DistributedDataParallel (also for --procs 1),
             SGD(lr=0.05, momentum=0.9), mean cross_entropy. The global batch B is split evenly
             (B/N samples per rank per step); synthetic data is generated up front per rank from
             a fixed seed (untimed; a pool of at most --shard * 16 batches, cycled). 20 warm-up
             steps, then S steps timed between two barriers. Rank 0 prints:
               ddp procs=N batch=B steps=S steps_per_s=X

Nothing else is printed on stdout (warnings may appear on stderr).

usage:
  /opt/troupe-venv/bin/python bench/train_peers.py allreduce --procs 2 --mib 1 16 --iters 5
  /opt/troupe-venv/bin/python bench/train_peers.py ddp --procs 2 --steps 200 --batch 64 \
      --features 32 --hidden 64 --classes 4 --shard 16 --threads 1
"""
import warnings

# torch in this venv is built with NumPy support but NumPy is not installed: silence that warning.
warnings.filterwarnings("ignore", message=".*Failed to initialize NumPy.*")

import argparse
import datetime
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

WARMUP_ALLREDUCE = 3
WARMUP_STEPS = 20
SEED = 1234
TIMEOUT = datetime.timedelta(seconds=120)


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init(rank, world, port):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=TIMEOUT)


def allreduce_worker(rank, world, port, sizes_mib, iters):
    init(rank, world, port)
    try:
        for mib in sizes_mib:
            t = torch.ones(int(mib * 2 ** 18), dtype=torch.float32)
            for _ in range(WARMUP_ALLREDUCE):
                dist.all_reduce(t)
            dist.barrier()
            times = []
            for _ in range(iters):
                t0 = time.perf_counter()
                dist.all_reduce(t)
                times.append(time.perf_counter() - t0)
            if rank == 0:
                median = statistics.median(times)
                mean = statistics.fmean(times)
                algbw = mib * 2 ** 20 / median / 1e9
                print(f"gloo allreduce procs={world} mib={mib:g} median_ms={median * 1e3:.3f} "
                      f"mean_ms={mean * 1e3:.3f} algbw_gbs={algbw:.3f}", flush=True)
            del t
            dist.barrier()
    finally:
        dist.destroy_process_group()


def make_model(features, hidden, classes):
    return torch.nn.Sequential(
        torch.nn.Linear(features, hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, classes))


def ddp_worker(rank, world, port, a):
    torch.set_num_threads(a.threads)
    init(rank, world, port)
    try:
        per_rank = a.batch // world
        # Synthetic data, generated before any timing: a fixed pool of batches per rank.
        gen = torch.Generator().manual_seed(SEED + rank)
        pool = max(1, min(WARMUP_STEPS + a.steps, a.shard * 16))
        xs = torch.randn(pool, per_rank, a.features, generator=gen)
        ys = torch.randint(0, a.classes, (pool, per_rank), generator=gen)

        torch.manual_seed(SEED)  # same initial weights everywhere (DDP broadcasts rank 0's anyway)
        model = torch.nn.parallel.DistributedDataParallel(
            make_model(a.features, a.hidden, a.classes))
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

        def step(i):
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(xs[i % pool]), ys[i % pool])
            loss.backward()
            opt.step()

        for i in range(WARMUP_STEPS):
            step(i)
        dist.barrier()
        t0 = time.perf_counter()
        for i in range(a.steps):
            step(WARMUP_STEPS + i)
        dist.barrier()
        elapsed = time.perf_counter() - t0
        if rank == 0:
            print(f"ddp procs={world} batch={a.batch} steps={a.steps} "
                  f"steps_per_s={a.steps / elapsed:.1f}", flush=True)
        # DDP's reducer must go before its process group: destroying the group under a live
        # reducer aborted a rank at exit (4 processes).
        del model, opt
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="mode", required=True)
    ar = sub.add_parser("allreduce", help="gloo all_reduce latency / algorithmic bandwidth")
    ar.add_argument("--procs", type=int, default=2)
    ar.add_argument("--mib", type=float, nargs="+", default=[1.0])
    ar.add_argument("--iters", type=int, default=20)
    dp = sub.add_parser("ddp", help="DistributedDataParallel MLP training throughput")
    dp.add_argument("--procs", type=int, default=2)
    dp.add_argument("--steps", type=int, default=200)
    dp.add_argument("--batch", type=int, default=64, help="global batch, split evenly over procs")
    dp.add_argument("--features", type=int, default=32)
    dp.add_argument("--hidden", type=int, default=64)
    dp.add_argument("--classes", type=int, default=4)
    dp.add_argument("--shard", type=int, default=16,
                    help="data pool per rank holds at most shard*16 batches (cycled)")
    dp.add_argument("--threads", type=int, default=1, help="torch.set_num_threads per process")
    a = p.parse_args()

    if a.procs < 1:
        p.error("--procs must be >= 1")
    # Keep gloo's own sockets on loopback too.
    if os.path.isdir("/sys/class/net/lo"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    port = free_port()
    if a.mode == "allreduce":
        if a.iters < 1 or any(m <= 0 for m in a.mib):
            p.error("--iters must be >= 1 and every --mib > 0")
        mp.spawn(allreduce_worker, args=(a.procs, port, a.mib, a.iters), nprocs=a.procs, join=True)
    else:
        if a.batch % a.procs or a.batch < a.procs:
            p.error(f"--batch {a.batch} must be a positive multiple of --procs {a.procs}")
        if a.steps < 1 or a.threads < 1 or a.shard < 1:
            p.error("--steps, --threads and --shard must be >= 1")
        mp.spawn(ddp_worker, args=(a.procs, port, a), nprocs=a.procs, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
