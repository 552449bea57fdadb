#!/usr/bin/env python3
"""Start-up time and memory of a node: runs `BINARY --serve 127.0.0.1:0 --devices cpu,cpu` several
times, measures the wall time until it prints "serving on HOST:PORT" and its resident memory
(VmRSS, VmHWM) at that moment, then stops it with SIGTERM. Prints one line per binary with the
median and range over the runs.

    bench/node_startup.py [--runs 7] BINARY [BINARY ...]
"""
import argparse
import os
import signal
import statistics
import subprocess
import sys
import time


def status_kib(pid, key):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def one_run(binary):
    start = time.perf_counter()
    p = subprocess.Popen([binary, "--serve", "127.0.0.1:0", "--devices", "cpu,cpu"],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        for line in p.stdout:
            if line.startswith("serving on"):
                elapsed = time.perf_counter() - start
                return elapsed, status_kib(p.pid, "VmRSS"), status_kib(p.pid, "VmHWM")
        raise RuntimeError(f"{binary} ended without serving")
    finally:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("binaries", nargs="+")
    a = ap.parse_args()
    for b in a.binaries:
        one_run(b)  # warm the page cache
        runs = [one_run(b) for _ in range(a.runs)]
        t = [r[0] * 1000 for r in runs]
        rss = [r[1] / 1024 for r in runs]
        hwm = [r[2] / 1024 for r in runs]
        libtorch = "yes" if "libtorch" in subprocess.run(["ldd", b], capture_output=True,
                                                          text=True).stdout else "no"
        print(f"{b}: start-up to listening {statistics.median(t):.0f} ms "
              f"({min(t):.0f}-{max(t):.0f}), RSS {statistics.median(rss):.1f} MiB "
              f"(peak {statistics.median(hwm):.1f} MiB), links LibTorch: {libtorch}")


if __name__ == "__main__":
    sys.exit(main())
