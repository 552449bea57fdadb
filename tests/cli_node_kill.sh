#!/usr/bin/env bash
# The acceptance run of docs/api.md "Several machines" with the example binary: two nodes on
# loopback, a coordinator over both, one node killed with SIGKILL two seconds into the run; the
# result must be exact.
set -euo pipefail
source "$(dirname "$0")/node_lib.sh"
bin=$1
loopback_two_nodes
( sleep 2; kill -9 "${pids[0]}" ) &
"$bin" --nodes "$a,$b" --items 3000 --work-ms 4 | tee "$dir/out"
expected=$(python3 -c 'print(sum(x * x for x in range(3000)))')
grep -qx "result: $expected" "$dir/out"
echo "exact result with one node killed: ok"
