#!/usr/bin/env bash
# A rolling restart's cost (docs/deploy.md, "Rolling restarts and maintenance"): the
# sum_of_squares example over 3 local node processes (2 CPU producers each, --work-ms per item),
# once undisturbed and once while each node in turn gets SIGTERM (it drains and exits 0) and is
# started again on its address (the coordinator, following the cluster, takes it back). Prints
# both job times and each node's drain time (SIGTERM to exit).
#
#   bench/rolling_restart.sh [BIN] [ITEMS] [WORK_MS]     (defaults: build/examples/sum_of_squares 6000 2)
set -euo pipefail
bin=${1:-build/examples/sum_of_squares}
items=${2:-6000}
work=${3:-2}
dir=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done; rm -rf "$dir"; }
trap cleanup EXIT
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
addr=()
for i in 0 1 2; do
  addr+=("127.0.0.1:$(port)")
  "$bin" --serve "${addr[$i]}" --devices cpu,cpu > "$dir/node$i" 2>&1 &
  pids[$i]=$!
done
for i in 0 1 2; do
  for _ in $(seq 100); do grep -q "serving on" "$dir/node$i" && break; sleep 0.05; done
done
nodes=$(IFS=,; echo "${addr[*]}")
now() { date +%s.%N; }
t0=$(now)
"$bin" --nodes "$nodes" --items "$items" --work-ms "$work" --progress off > "$dir/quiet" 2>/dev/null
t1=$(now)
quiet=$(python3 -c "print(f'{$t1 - $t0:.2f}')")
(
  sleep 1
  for i in 0 1 2; do
    s=$(now)
    kill -TERM "${pids[$i]}"
    while kill -0 "${pids[$i]}" 2>/dev/null; do sleep 0.01; done
    e=$(now)
    echo "node $i drained in $(python3 -c "print(f'{($e - $s) * 1000:.0f}')") ms" >> "$dir/drains"
    "$bin" --serve "${addr[$i]}" --devices cpu,cpu > "$dir/node$i.b" 2>&1 &
    echo $! > "$dir/pid$i"
    for _ in $(seq 100); do grep -q "serving on" "$dir/node$i.b" && break; sleep 0.05; done
    sleep 0.8  # it rejoins (reconnect_every 1 s), then the next one goes
  done
) &
roller=$!
t2=$(now)
"$bin" --nodes "$nodes" --items "$items" --work-ms "$work" --progress off > "$dir/rolled" 2> "$dir/rolled.err"
t3=$(now)
wait "$roller" || true
for i in 0 1 2; do [ -f "$dir/pid$i" ] && pids+=("$(cat "$dir/pid$i")"); done
rolled=$(python3 -c "print(f'{$t3 - $t2:.2f}')")
cmp -s <(grep result "$dir/quiet") <(grep result "$dir/rolled") || { echo "results differ"; exit 1; }
grep result "$dir/rolled"
echo "undisturbed: ${quiet} s; with each of 3 nodes SIGTERMed and restarted in turn: ${rolled} s"
cat "$dir/drains" 2>/dev/null || echo "(the job ended before every node was restarted)"
grep -c "rejoined" "$dir/rolled.err" | sed 's/^/rejoined events: /'
if grep -q " lost " "$dir/rolled.err"; then echo "a node was reported lost"; exit 1; fi
