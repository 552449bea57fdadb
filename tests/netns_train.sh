#!/usr/bin/env bash
# Training across hosts on one machine: two nodes and a coordinator, each in a network namespace
# of its own (created and removed here), linked by veth pairs. examples/train runs with
# --deterministic on the two nodes' replicas; once its first epoch is done the link to one node is
# cut (its process keeps running, unreachable). Not a second into the run: on a loaded machine the
# coordinator may still be connecting then, and the test would cut a handshake instead. The survivor recomputes its shards; the params line
# must be the one of a run on one local device. Then a fast-mode run with a wider model (rings
# over the replicas' direct connections, routed through the coordinator's namespace) with the
# other link cut mid-training. Needs root and iproute2; exits 77 (skipped, with
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
# Cuts namespace $1's link once file $2 shows the run's first epoch (at most 60 s).
cut_after_first_epoch() {
  for _ in $(seq 600); do grep -Eq '^(epoch 1:|error)' "$2" 2>/dev/null && break; sleep 0.1; done
  ip netns exec "$1" ip link set "$1" down
}
( cut_after_first_epoch "${tag}n1" "$dir/cut"; echo "link to $a cut" ) &
ip netns exec "$coord" "$bin" --nodes "$a,$b" "${args[@]}" | tee "$dir/cut"
grep -q "^lost replicas: 1" "$dir/cut"
local_params=$(grep '^params:' "$dir/local")
[ -n "$local_params" ]
[ "$local_params" = "$(grep '^params:' "$dir/cut")" ]
echo "same params with a node's link cut mid-training as on one local device: ok"

# Fast mode with a 1.1 MiB gradient: the nodes all-reduce in a ring over their direct
# connections, which go through the coordinator's namespace (routed there). Node 2's link is cut
# mid-training, in the middle of a ring or not: the run goes on with the survivor and learns.
ip netns exec "${tag}n1" ip link set "${tag}n1" up  # node 1 is back (cut in the first run)
# ... once the coordinator's namespace reaches it again (a neighbour entry that failed while the
# link was down would refuse the first connections).
ip netns exec "$coord" ip neigh flush all
for _ in $(seq 100); do
  ip netns exec "$coord" timeout 1 bash -c "exec 3<>/dev/tcp/${a%:*}/${a##*:}" 2>/dev/null && break
  sleep 0.1
done
ip netns exec "$coord" sysctl -qw net.ipv4.ip_forward=1
ip netns exec "${tag}n1" ip route add "10.232.2.0/24" via "10.232.1.1"
ip netns exec "${tag}n2" ip route add "10.232.1.0/24" via "10.232.2.1"
fast=(--epochs 6 --samples 12000 --hidden 512)
( cut_after_first_epoch "${tag}n2" "$dir/ring"; echo "link to $b cut" ) &
cutter=$!
ip netns exec "$coord" "$bin" --nodes "$a,$b" "${fast[@]}" | tee "$dir/ring"
wait "$cutter"
grep -q "^lost replicas: 1" "$dir/ring"
grep -Eq "^ring reductions: [1-9][0-9]*, over direct connections: [1-9]" "$dir/ring"
awk '/^result:/ { exit !($2 >= 0.8) }' "$dir/ring"
echo "rings over direct connections between namespaces, one cut mid-training: ok"
