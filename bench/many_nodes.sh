#!/usr/bin/env bash
# Many node processes on this machine (docs/api.md, "Several machines"): N nodes of sum_of_squares
# (1 CPU producer each, --serve 127.0.0.1:0), then one coordinator that follows them as a live
# cluster (--nodes alone; connect tries every node at once) and runs ITEMS items of WORK_MS each (a
# sleep: the nodes wait, as for a device). Prints the connect time, the run's time against the ideal
# (ITEMS x WORK_MS / N), the coordinator's CPU per chunk (over the whole run, and during the job
# alone), and checks the result. With KILL=K, K nodes are SIGKILLed at once a second into the run:
# the result must still be exact. With FROZEN=F and DEAD=D, F of the nodes are frozen (SIGSTOP) and
# D addresses with nothing listening are added before the connect, and MIN_NODES=M is passed as
# --min-nodes: the connect must return with the nodes that answer (the time to the runner's start is
# printed). With ROLLING=W, a rolling restart a second into the run: W nodes at a time get SIGTERM
# (each drains and exits), are started again on their addresses, and once they serve the next W go;
# the result must be exact and the coordinator's log must show no node `lost` (a drained node is
# removed, never lost), only `draining`, `drained` and `rejoined`.
#   bench/many_nodes.sh build/examples/sum_of_squares 128 20000 2
#   ROLLING=8 bench/many_nodes.sh build/examples/sum_of_squares 128 64000 20
set -euo pipefail
bin=$1
n=${2:-16}
items=${3:-20000}
work_ms=${4:-2}
kill_n=${KILL:-0}
dir=$(mktemp -d)
pids=()
cleanup() {
  exec 2>/dev/null  # no "Killed" line for each node
  [ -n "${rolling:-}" ] && kill -9 "$rolling" 2>/dev/null
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  [ -f "$dir/restarted" ] && while read -r p; do kill -9 "$p" 2>/dev/null || true; done <"$dir/restarted"
  rm -rf "$dir"
}
trap cleanup EXIT
for i in $(seq "$n"); do
  "$bin" --serve 127.0.0.1:0 --devices cpu > "$dir/node$i" 2>/dev/null &
  pids+=($!)
done
addresses=()
for i in $(seq "$n"); do
  for _ in $(seq 200); do grep -q "serving on" "$dir/node$i" 2>/dev/null && break; sleep 0.05; done
  addresses+=("$(sed -n 's/serving on //p' "$dir/node$i")")
done
for i in $(seq "${FROZEN:-0}"); do kill -STOP "${pids[$((n - i))]}"; done
for _ in $(seq "${DEAD:-0}"); do
  addresses+=("$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print("127.0.0.1:%d" % s.getsockname()[1])')")
done
list=$(IFS=,; echo "${addresses[*]}")
if [ "$kill_n" -gt 0 ]; then
  ( sleep 1; for i in $(seq "$kill_n"); do kill -9 "${pids[$((i - 1))]}"; done; echo "killed $kill_n nodes" >&2 ) &
fi
alive() {  # PID: running, not a zombie
  local st; st=$(awk '{sub(/.*\) /, ""); print $1}' "/proc/$1/stat" 2>/dev/null) || return 1
  [ -n "$st" ] && [ "$st" != Z ]
}
if [ -n "${ROLLING:-}" ]; then
  (
    sleep 1
    t0=$(date +%s.%N)
    for ((i = 0; i < n; i += ROLLING)); do
      last=$((i + ROLLING < n ? i + ROLLING : n))
      for ((k = i; k < last; k++)); do kill -TERM "${pids[k]}"; done
      for ((k = i; k < last; k++)); do while alive "${pids[k]}"; do sleep 0.01; done; done
      for ((k = i; k < last; k++)); do
        "$bin" --serve "${addresses[k]}" --devices cpu >"$dir/again$k" 2>/dev/null &
        echo $! >>"$dir/restarted"
      done
      for ((k = i; k < last; k++)); do
        for _ in $(seq 400); do grep -q "serving on" "$dir/again$k" 2>/dev/null && break; sleep 0.05; done
      done
    done
    echo "rolling restart of $n nodes, $ROLLING at a time: $(python3 -c "import sys; print('%.1f' % (float(sys.argv[2]) - float(sys.argv[1])))" "$t0" "$(date +%s.%N)") s" >&2
    touch "$dir/rolled"
  ) &
  rolling=$!
fi
start=$(date +%s.%N)
# Each line of the coordinator's log with the seconds since the start.
stamp() { python3 -u -c '
import sys, time
t0 = time.monotonic()
for line in sys.stdin:
    print("%.3f %s" % (time.monotonic() - t0, line), end="", flush=True)'; }
/usr/bin/time -f "%U %S" -o "$dir/cpu" "$bin" --nodes "$list" --items "$items" --work-ms "$work_ms" --progress on ${TRACE:+--trace "$TRACE"} \
  ${MIN_NODES:+--min-nodes "$MIN_NODES"} -v > "$dir/out" 2> >(stamp > "$dir/log") || { sleep 1; tail -20 "$dir/log"; exit 1; }
end=$(date +%s.%N)  # (before this script's own wait below: it used to be counted)
sleep 0.5  # the stamper's last lines
cp "$dir/log" /tmp/many_nodes_last.log
expected=$(python3 -c "print(sum(x * x for x in range($items)))")
grep -qx "result: $expected" "$dir/out" || { echo "wrong result: $(cat "$dir/out")"; exit 1; }
python3 - "$start" "$end" "$items" "$work_ms" "$n" "$(cat "$dir/cpu")" <<'PY'
import sys
start, end, items, work_ms, n = float(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])
user, system = (float(x) for x in sys.argv[6].split())
wall = end - start
ideal = items * work_ms / 1000 / n
print(f"{n} nodes, {items} items of {work_ms} ms: {wall:.2f} s (connect and start included), "
      f"ideal {ideal:.2f} s, efficiency {ideal / wall:.2f}; coordinator CPU {user + system:.2f} s ({(user + system) / items * 1e6:.1f} us per item)")
PY
job=$(sed -n 's/^[0-9.]* done: [0-9]* items in \([0-9.]*\) s.*/\1/p' "$dir/log")
[ -n "$job" ] && python3 -c "import sys; j, i = float(sys.argv[1]), $items * $work_ms / 1000 / $n; print(f'the job alone: {j:.2f} s, efficiency {i / j:.2f}')" "$job"
chunks=$(sed -n 's/^[0-9.]* chunks: \([0-9]*\) answered whole, \([0-9]*\) split.*/\1 \2/p' "$dir/log")
[ -n "$chunks" ] && python3 -c "import sys; w, s = map(int, sys.argv[2:4]); u, k = map(float, sys.argv[1].split()); print(f'chunks: {w} answered whole + {s} split; coordinator CPU {(u + k) / (w + s) * 1e6:.0f} us per chunk (start-up and connect included)')" "$(cat "$dir/cpu")" $chunks
job_cpu=$(sed -n 's/^[0-9.]* CPU of this process during the job: \([0-9.e-]*\) s/\1/p' "$dir/log")
[ -n "$chunks" ] && [ -n "$job_cpu" ] && python3 -c "import sys; c = float(sys.argv[1]); w, s = map(int, sys.argv[2:4]); print(f'coordinator CPU during the job alone: {c:.3f} s, {c / (w + s) * 1e6:.0f} us per chunk')" "$job_cpu" $chunks
echo "runner started after $(sed -n 's/^\([0-9.]*\) .*runner started.*/\1/p' "$dir/log") s (connect included)"
if [ -n "${ROLLING:-}" ]; then
  [ -f "$dir/rolled" ] || echo "the job ended before the rolling restart did: more items, or a larger ROLLING"
  for what in draining drained rejoined lost; do
    echo "cluster events \"$what\": $(grep -v '\[troupe' "$dir/log" | grep -c "cluster: .* $what (" || true)"
  done
  if grep -q "cluster: .* lost (" "$dir/log"; then echo "a node was lost in the rolling restart"; exit 1; fi
fi
echo "exact result"
