#!/usr/bin/env bash
# examples/records across a real node process: structs holding a string and a tensor go to the
# node and back; every name must come back, in order, and the totals must be exact.
set -euo pipefail
source "$(dirname "$0")/node_lib.sh"
bin=$1
items=${2:-50}
dir=$(mktemp -d)
pid=
cleanup() { [ -n "$pid" ] && kill -9 "$pid" 2>/dev/null || true; rm -rf "$dir"; }
trap cleanup EXIT
"$bin" --serve 127.0.0.1:0 --devices cpu,cpu > "$dir/node" &
pid=$!
address=$(served_address "$dir/node")
"$bin" --nodes "$address" --items "$items" | tee "$dir/out"
expected=$(python3 -c "print(float(sum((i % 5) * (i % 5 + 1) // 2 for i in range($items))))")
grep -qx "result: ${expected%.0}" "$dir/out" || grep -qx "result: $expected" "$dir/out"
echo "records crossed a node and came back exact: ok"
