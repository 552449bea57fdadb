#!/usr/bin/env bash
# Training across hosts on one machine: two nodes and a coordinator, each in a network namespace
# of its own (created and removed here), linked by veth pairs. examples/train runs with
# --deterministic on the two nodes' replicas; a second into the run the link to one node is cut
# (its process keeps running, unreachable). The survivor recomputes its shards; the params line
# must be the one of a run on one local device. Needs root and iproute2; exits 77 (skipped, with
# the reason) where namespaces are not allowed. Nothing here talks to any address outside these
# namespaces.
set -euo pipefail
source "$(dirname "$0")/node_lib.sh"
bin=$1
tag="tt$$"
coord="${tag}c"
dir=$(mktemp -d)
pids=()
if ! ip netns add "$coord" 2>"$dir/err"; then
  echo "skipped: cannot create a network namespace here ($(head -c 200 "$dir/err"))"
  rm -rf "$dir"
  exit 77
fi
cleanup() {
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  for ns in "$coord" "${tag}n1" "${tag}n2"; do ip netns del "$ns" 2>/dev/null || true; done
  rm -rf "$dir"
}
trap cleanup EXIT
ip netns exec "$coord" ip link set lo up
for i in 1 2; do
  ns="${tag}n$i"
  ip netns add "$ns"
  ip netns exec "$ns" ip link set lo up
  ip link add "${tag}c$i" netns "$coord" type veth peer name "${tag}n$i" netns "$ns"
  ip netns exec "$coord" ip addr add "10.232.$i.1/24" dev "${tag}c$i"
  ip netns exec "$coord" ip link set "${tag}c$i" up
  ip netns exec "$ns" ip addr add "10.232.$i.2/24" dev "${tag}n$i"
  ip netns exec "$ns" ip link set "${tag}n$i" up
  ip netns exec "$ns" "$bin" --serve "10.232.$i.2:0" --devices cpu > "$dir/node$i" &
  pids+=($!)
done
a=$(served_address "$dir/node1")
b=$(served_address "$dir/node2")
echo "nodes: $a (namespace ${tag}n1), $b (namespace ${tag}n2)"
args=(--epochs 6 --samples 12000 --deterministic)
"$bin" --devices cpu "${args[@]}" | tee "$dir/local"
( sleep 1; ip netns exec "${tag}n1" ip link set "${tag}n1" down; echo "link to $a cut" ) &
ip netns exec "$coord" "$bin" --nodes "$a,$b" "${args[@]}" | tee "$dir/cut"
grep -q "^lost replicas: 1" "$dir/cut"
local_params=$(grep '^params:' "$dir/local")
[ -n "$local_params" ]
[ "$local_params" = "$(grep '^params:' "$dir/cut")" ]
echo "same params with a node's link cut mid-training as on one local device: ok"
