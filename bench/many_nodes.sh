#!/usr/bin/env bash
# Many node processes on this machine (docs/api.md, "Several machines"): N nodes of
# sum_of_squares (1 CPU producer each, --serve 127.0.0.1:0), then one coordinator that follows
# them as a live cluster (--nodes alone; connect tries every node at once) and runs ITEMS items
# of WORK_MS each (a sleep: the nodes wait, as for a device). Prints the connect time, the run's
# time against the ideal (ITEMS x WORK_MS / N), the coordinator's CPU seconds per chunk, and
# checks the result. With KILL=K, K nodes are SIGKILLed at once a second into the run: the
# result must still be exact.
#   bench/many_nodes.sh build/examples/sum_of_squares 128 20000 2
set -euo pipefail
bin=$1
n=${2:-16}
items=${3:-20000}
work_ms=${4:-2}
kill_n=${KILL:-0}
dir=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
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
list=$(IFS=,; echo "${addresses[*]}")
if [ "$kill_n" -gt 0 ]; then
  ( sleep 1; for i in $(seq "$kill_n"); do kill -9 "${pids[$((i - 1))]}"; done; echo "killed $kill_n nodes" >&2 ) &
fi
start=$(date +%s.%N)
/usr/bin/time -f "%U %S" -o "$dir/cpu" "$bin" --nodes "$list" --items "$items" --work-ms "$work_ms" \
  -v > "$dir/out" 2> "$dir/log" || { tail -20 "$dir/log"; exit 1; }
end=$(date +%s.%N)
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
echo "exact result"
