#!/usr/bin/env bash
# examples/train with --deterministic: the params line must not depend on the number of replicas,
# nor on a node that is SIGKILLed in the middle of training (its replica kills its own process
# at its 40th shard; the survivor recomputes its shards in the same step).
set -euo pipefail
source "$(dirname "$0")/node_lib.sh"
bin=$1
dir=$(mktemp -d)
pid=
cleanup() { [ -n "$pid" ] && kill -9 "$pid" 2>/dev/null || true; rm -rf "$dir"; }
trap cleanup EXIT
args=(--epochs 2 --samples 3000 --deterministic)
"$bin" --devices cpu "${args[@]}" | tee "$dir/one"
"$bin" --devices cpu,cpu,cpu "${args[@]}" | tee "$dir/three"
"$bin" --serve 127.0.0.1:0 --devices cpu > "$dir/node" &
pid=$!
address=$(served_address "$dir/node")
"$bin" --nodes "$address" --devices cpu --kill-node-at-shard 40 "${args[@]}" | tee "$dir/killed"
grep -q "^lost replicas: 1" "$dir/killed"
wait "$pid" && { echo "the node was not killed"; exit 1; } || true
pid=
one=$(grep '^params:' "$dir/one")
[ -n "$one" ]
[ "$one" = "$(grep '^params:' "$dir/three")" ]
[ "$one" = "$(grep '^params:' "$dir/killed")" ]
echo "same params with 1 device, 3 devices and a killed node: ok"
