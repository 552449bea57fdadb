#!/usr/bin/env bash
# --min-nodes in an example that does not follow a cluster (sum_of_powers): two nodes on
# loopback and an address with nothing listening. With --min-nodes 2 the run uses the two
# that answer and its result is exact; with --min-nodes 3 it fails, saying how many answered.
# (Before, only sum_of_squares read --min-nodes: the others required every node.)
set -euo pipefail
source "$(dirname "$0")/node_lib.sh"
bin=$1
loopback_two_nodes
silent=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print("127.0.0.1:%d" % s.getsockname()[1])')
expected=$(python3 -c 'print(sum(x ** 3 for x in range(2000)))')
"$bin" --nodes "$a,$b,$silent" --min-nodes 2 --items 2000 --progress off | tee "$dir/out"
grep -qx "result: $expected" "$dir/out"
echo "--min-nodes 2 of 3 (one silent): exact result"
if "$bin" --nodes "$a,$b,$silent" --min-nodes 3 --items 10 --progress off 2>"$dir/err"; then
  echo "--min-nodes 3 with one silent address ran" >&2
  exit 1
fi
grep -q "2 of 3 nodes answered, min_nodes is 3" "$dir/err" || { cat "$dir/err" >&2; exit 1; }
echo "--min-nodes 3 of 3 (one silent): refused, saying so"
