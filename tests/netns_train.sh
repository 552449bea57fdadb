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
netns_two_nodes "tt$$" 232 --devices cpu
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
