#!/usr/bin/env bash
# The acceptance run of docs/api.md "Several machines" with the example binary: two nodes on
# loopback, a coordinator over both, one node killed with SIGKILL two seconds into the run; the
# result must be exact.
set -euo pipefail
source "$(dirname "$0")/node_lib.sh"
bin=$1
dir=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done; rm -rf "$dir"; }
trap cleanup EXIT
for i in 1 2; do
  "$bin" --serve 127.0.0.1:0 --devices cpu,cpu > "$dir/node$i" &
  pids+=($!)
done
a=$(served_address "$dir/node1")
b=$(served_address "$dir/node2")
( sleep 2; kill -9 "${pids[0]}" ) &
"$bin" --nodes "$a,$b" --items 3000 --work-ms 4 | tee "$dir/out"
expected=$(python3 -c 'print(sum(x * x for x in range(3000)))')
grep -qx "result: $expected" "$dir/out"
echo "exact result with one node killed: ok"
