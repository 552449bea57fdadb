#!/usr/bin/env bash
# An operator's rolling restart with the example binary (docs/api.md, "node": leaving
# gracefully): two nodes on loopback, a coordinator over both with --trace; node 1 gets SIGTERM
# mid-run, drains (its producers finish their chunks, the coordinator reports them removed) and
# exits 0 printing "stopped"; the result is exact; the trace is JSON with a lane per producer
# and the removals in it.
set -euo pipefail
source "$(dirname "$0")/node_lib.sh"
bin=$1
loopback_two_nodes
( sleep 1.5; kill -TERM "${pids[0]}" ) &
"$bin" --nodes "$a,$b" --items 3000 --work-ms 4 --trace "$dir/trace.json" --progress off \
  | tee "$dir/out"
expected=$(python3 -c 'print(sum(x * x for x in range(3000)))')
grep -qx "result: $expected" "$dir/out"
rc=0
wait "${pids[0]}" || rc=$?
[ "$rc" -eq 0 ] || { echo "the SIGTERMed node exited $rc"; cat "$dir/node1"; exit 1; }
grep -qx "stopped" "$dir/node1" || { echo "the node did not say stopped"; exit 1; }
python3 - "$dir/trace.json" <<'PY'
import json, sys
t = json.load(open(sys.argv[1]))
ev = t["traceEvents"]
lanes = [e for e in ev if e["ph"] == "M" and e["name"] == "thread_name"]
assert len(lanes) == 5, lanes  # the scheduler and 4 producers
removed = [e for e in ev if e["ph"] == "i" and e["name"] == "removed"]
assert len(removed) == 2, removed  # node 1's two producers, drained
assert not [e for e in ev if e["ph"] == "i" and e["name"] == "lost"], "a drained node was lost"
print("trace:", len(ev), "events,", len(removed), "removed, none lost")
PY
echo "rolling restart step: exact result, node exited 0: ok"
