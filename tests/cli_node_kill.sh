#!/usr/bin/env bash
# The acceptance run of docs/api.md "Several machines" with the example binary: two nodes on
# loopback, a coordinator over both, one node killed with SIGKILL half a second after the runner
# started; the result must be exact, and its --trace must show the loss (lanes named, no
# overlap, every item in a slice answered ok).
set -euo pipefail
source "$(dirname "$0")/node_lib.sh"
bin=$1
loopback_two_nodes
( after_runner_started "$dir/err"; kill -9 "${pids[0]}" ) &
"$bin" --nodes "$a,$b" --items 3000 --work-ms 4 --trace "$dir/trace.json" -v 2> "$dir/err" |
  tee "$dir/out" || { cat "$dir/err"; exit 1; }
cat "$dir/err"
expected=$(python3 -c 'print(sum(x * x for x in range(3000)))')
grep -qx "result: $expected" "$dir/out"
echo "exact result with one node killed: ok"
# The trace of that run (Perfetto's format): valid JSON; every lane a slice is on is named; no
# two slices overlap on a lane; the slices answered ok cover every item; the loss is marked.
python3 - "$dir/trace.json" <<'PY'
import json, sys
ev = json.load(open(sys.argv[1]))["traceEvents"]
named = {(e["pid"], e["tid"]) for e in ev if e["ph"] == "M" and e["name"] == "thread_name"}
procs = {e["pid"] for e in ev if e["ph"] == "M" and e["name"] == "process_name"}
chunks = [e for e in ev if e["ph"] == "X" and e["name"].startswith("job ")]
lanes = {}
for e in chunks:
    assert (e["pid"], e["tid"]) in named, ("a slice on an unnamed lane", e)
    assert e["pid"] in procs, ("a slice in an unnamed process", e)
    lanes.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
for lane, spans in lanes.items():
    spans.sort()
    for x, y in zip(spans, spans[1:]):
        assert y[0] + 1e-3 >= x[1], ("overlap on lane", lane, x, y)
covered = [False] * 3000
for e in chunks:
    if e["args"]["ok"]:
        for i in range(e["args"]["first"], e["args"]["first"] + e["args"]["items"]):
            covered[i] = True
assert all(covered), "items with no slice answered ok: %d" % covered.count(False)
lost = [e for e in ev if e["ph"] == "i" and e["name"] == "lost"]
assert lost, "the killed node's producers are not marked lost"
assert len(procs) == 3, ("the coordinator and two nodes", procs)
print("trace:", len(chunks), "chunk slices on", len(lanes), "lanes, none overlapping,",
      len(lost), "lost marked, every item covered")
PY
