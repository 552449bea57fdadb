#!/usr/bin/env python3
"""Liveness cost of a nearly idle live cluster, per member, on the coordinator.

  BIN=build/examples/sum_of_squares bench/heartbeat_cost.py MODE N [WORK_MS] [WINDOW_S]
  NODE_ARGS="--heartbeat-ms 1000 --idle-timeout-ms 5000" \
  COORD_ARGS="--probes-per-second 128 --heartbeat-ms 1000 --idle-timeout-ms 5000" \
    bench/heartbeat_cost.py live 128      (BENCHMARKS.md, "Heartbeats at many members")

MODE live:   coordinator `--nodes a,b,...` alone (a live cluster: watcher hello probes every
             cluster_options::heartbeat = 200 ms per member + CAF BASP heartbeats, 200 ms per
             connection).
MODE static: coordinator `--nodes a,b,... --devices cpu` (a plain runner over the nodes' devices
             plus one local cpu producer: BASP heartbeats only, no watcher).

Starts N nodes of sum_of_squares (`--serve 127.0.0.1:0 --devices cpu`, in batches of 16, each
waited for until it prints "serving on"), samples the nodes alone for WINDOW_S (no coordinator),
then starts the coordinator with --items N --work-ms WORK_MS --progress off -v (one item of
WORK_MS ms, a sleep, per node). Once its log says "runner started", waits 2 s and samples the
coordinator's and the nodes' utime+stime (/proc/PID/stat, 100 ticks/s) over WINDOW_S. Prints one
JSON line. Every process it started is SIGKILLed by PID at the end (also on failure).
"""
import json, os, signal, subprocess, sys, threading, time

BIN = os.environ.get("BIN", "build/examples/sum_of_squares")
NODE_ARGS = os.environ.get("NODE_ARGS", "").split()
COORD_ARGS = os.environ.get("COORD_ARGS", "").split()
TAG = os.environ.get("TAG", "")
HZ = os.sysconf("SC_CLK_TCK")

mode, n = sys.argv[1], int(sys.argv[2])
work_ms = int(sys.argv[3]) if len(sys.argv) > 3 else 16000
window = float(sys.argv[4]) if len(sys.argv) > 4 else 10.0
assert mode in ("live", "static")

started = []  # Popen of every process this script started


def cleanup():
    for p in started:
        if p.poll() is None:
            try:
                os.kill(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p in started:
        try:
            p.wait(timeout=5)
        except Exception:
            pass


def ticks(pid):
    with open(f"/proc/{pid}/stat") as f:
        rest = f.read().rsplit(")", 1)[1].split()
    return int(rest[11]) + int(rest[12])  # utime, stime (fields 14, 15)


def sys_busy():
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return sum(v) - v[3] - v[4], sum(v)  # busy (all but idle, iowait), total


def sample(pids, secs):
    b0, t0 = sys_busy()
    a = {p: ticks(p) for p in pids}
    w0 = time.monotonic()
    time.sleep(secs)
    b = {p: ticks(p) for p in pids}
    w = time.monotonic() - w0
    b1, t1 = sys_busy()
    return {p: (b[p] - a[p]) / HZ / w for p in pids}, (b1 - b0) / HZ / w


try:
    tmp = f"/tmp/heartbeat_cost_{TAG}_{mode}_{n}_{os.getpid()}"
    os.makedirs(tmp, exist_ok=True)
    nodes, addresses = [], []
    t_nodes = time.monotonic()
    for first in range(0, n, 16):
        batch = []
        for i in range(first, min(n, first + 16)):
            out = open(f"{tmp}/node{i}", "w")
            p = subprocess.Popen([BIN, "--serve", "127.0.0.1:0", "--devices", "cpu"] + NODE_ARGS, stdout=out,
                                 stderr=subprocess.DEVNULL)
            started.append(p)
            nodes.append(p)
            batch.append(i)
        for i in batch:
            for _ in range(600):
                s = open(f"{tmp}/node{i}").read()
                if "serving on" in s:
                    addresses.append(s.split("serving on ", 1)[1].split()[0])
                    break
                if nodes[i].poll() is not None:
                    raise SystemExit(f"node {i} exited")
                time.sleep(0.05)
            else:
                raise SystemExit(f"node {i} does not serve")
    t_nodes = time.monotonic() - t_nodes
    time.sleep(2)
    node_pids = [p.pid for p in nodes]
    idle, idle_sys = sample(node_pids, window)  # nodes alone
    nodes_alone = sum(idle.values())

    cmd = [BIN, "--nodes", ",".join(addresses), "--items", str(n), "--work-ms", str(work_ms),
           "--progress", "off", "-v"]
    if mode == "static":
        cmd += ["--devices", "cpu"]
    cmd += COORD_ARGS
    t0 = time.monotonic()
    coord = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    started.append(coord)
    log, ready = [], threading.Event()

    def read_log():
        for line in coord.stderr:
            log.append("%.3f %s" % (time.monotonic() - t0, line.rstrip()))
            if "runner started" in line:
                ready.set()

    threading.Thread(target=read_log, daemon=True).start()
    if not ready.wait(60):
        raise SystemExit("no 'runner started':\n" + "\n".join(log[-20:]))
    t_start = time.monotonic() - t0
    c_connect = ticks(coord.pid) / HZ
    time.sleep(2)
    rates, busy = sample([coord.pid] + node_pids, window)
    t_end = time.monotonic() - t0
    alive = coord.poll() is None
    try:
        out, _ = coord.communicate(timeout=work_ms / 1000 + 30)
    except subprocess.TimeoutExpired:
        out = "(timeout)"
    expected = sum(x * x for x in range(n))
    ok = f"result: {expected}" in out
    with open(f"{tmp}/coordinator.log", "w") as f:
        f.write("\n".join(log) + "\n" + out)
    nodes_sum = sum(rates[p] for p in node_pids)
    print(json.dumps({
        "tag": TAG, "node_args": NODE_ARGS, "coord_args": COORD_ARGS, "mode": mode, "n": n, "work_ms": work_ms, "window_s": window,
        "nodes_start_s": round(t_nodes, 1), "runner_started_s": round(t_start, 2),
        "window_s_after_coord_start": [round(t_end - window, 1), round(t_end, 1)],
        "coord_alive_through_window": alive, "result_ok": ok,
        "coord_cpu_connect_s": round(c_connect, 2),
        "coord_pct_core": round(100 * rates[coord.pid], 2),
        "nodes_total_pct_core": round(100 * nodes_sum, 2),
        "nodes_alone_total_pct_core": round(100 * nodes_alone, 2),
        "system_busy_pct_core": round(100 * busy, 1),
        "system_busy_nodes_alone_pct_core": round(100 * idle_sys, 1),
        "loadavg": open("/proc/loadavg").read().split()[:3],
        "log": tmp,
    }), flush=True)
finally:
    cleanup()
