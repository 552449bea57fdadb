#!/usr/bin/env bash
# An operator's rolling restart with the example binary (docs/api.md, "Pools that change"): two
# nodes on loopback, a coordinator over both (--nodes alone: its runner follows the cluster)
# with --trace; node 1 gets SIGTERM mid-run (once the runner has started), drains (its
# producers finish their chunks, the coordinator reports them removed) and exits 0 printing
# "stopped"; it is started again on the same address and rejoins the running job (its new
# producers take items); the result is exact; the coordinator reports draining, drained and
# rejoined for node 1 and never a loss.
set -euo pipefail
source "$(dirname "$0")/node_lib.sh"
bin=$1
loopback_two_nodes
(
  after_runner_started "$dir/err"
  kill -TERM "${pids[0]}"
  # the node exits once drained; then the same address again
  while kill -0 "${pids[0]}" 2>/dev/null; do sleep 0.05; done
  "$bin" --serve "$a" --devices cpu,cpu > "$dir/node1b" &
  echo $! > "$dir/restarted.pid"
) &
restarter=$!
"$bin" --nodes "$a,$b" --items 8000 --work-ms 4 --trace "$dir/trace.json" --progress off -v \
  > "$dir/out" 2> "$dir/err"
cat "$dir/out"
wait "$restarter" || true
[ -f "$dir/restarted.pid" ] && pids+=("$(cat "$dir/restarted.pid")")
expected=$(python3 -c 'print(sum(x * x for x in range(8000)))')
grep -qx "result: $expected" "$dir/out"
rc=0
wait "${pids[0]}" || rc=$?
[ "$rc" -eq 0 ] || { echo "the SIGTERMed node exited $rc"; cat "$dir/node1"; exit 1; }
grep -qx "stopped" "$dir/node1" || { echo "the node did not say stopped"; exit 1; }
cat "$dir/err"
for what in draining drained rejoined; do
  grep -q "cluster: $a $what" "$dir/err" || { echo "no '$what' reported for $a"; exit 1; }
done
if grep -q "cluster: .* lost" "$dir/err"; then echo "a graceful leave was reported lost"; exit 1; fi
python3 - "$dir/trace.json" <<'PY'
import json, sys
t = json.load(open(sys.argv[1]))
ev = t["traceEvents"]
lanes = [e for e in ev if e["ph"] == "M" and e["name"] == "thread_name"]
assert len(lanes) == 7, lanes  # the scheduler, 4 producers, 2 added when node 1 rejoined
removed = [e for e in ev if e["ph"] == "i" and e["name"] == "removed"]
assert len(removed) == 2, removed  # node 1's two producers, drained
added = [e for e in ev if e["ph"] == "i" and e["name"] == "added"]
assert len(added) == 2, added  # node 1's restart, rejoined
slices = {}
for e in ev:
    if e["ph"] == "X":
        slices[e["tid"]] = slices.get(e["tid"], 0) + 1
assert all(slices.get(e["tid"], 0) > 0 for e in added), "the rejoined producers took no chunk"
assert not [e for e in ev if e["ph"] == "i" and e["name"] == "lost"], "a drained node was lost"
print("trace:", len(ev), "events,", len(removed), "removed,", len(added), "added, none lost")
PY
echo "rolling restart step: exact result, node exited 0, rejoined the running job: ok"
