#!/usr/bin/env bash
# Several hosts on one machine: two nodes and a coordinator, each in a network namespace of its
# own (created and removed here) with its own address, linked by veth pairs. Half a second after
# the runner started, the link to one node is cut; its work must go to the other node and the
# result must be exact; once the link is back, a new coordinator uses both nodes again. Needs
# root and iproute2; exits 77 (skipped, with the reason) where namespaces are not allowed.
# Nothing here talks to any address outside these namespaces.
set -euo pipefail
source "$(dirname "$0")/node_lib.sh"
bin=$1
netns_two_nodes "tr$$" 231 --devices cpu,cpu
a=$(served_address "$dir/node1")
b=$(served_address "$dir/node2")
echo "nodes: $a (namespace ${tag}n1), $b (namespace ${tag}n2)"
case "$a$b" in *127.0.0.1*) echo "a node serves on loopback, not its own address"; exit 1 ;; esac
# The cut: node 1's end of its link goes down; its process keeps running, unreachable.
( after_runner_started "$dir/log"; ip netns exec "${tag}n1" ip link set "${tag}n1" down
  echo "link to $a cut" ) &
start=$(date +%s)
ip netns exec "$coord" "$bin" --nodes "$a,$b" --items 3000 --work-ms 4 -v 2>"$dir/log" | tee "$dir/out"
echo "run took $(( $(date +%s) - start )) s"
grep -i "lost" "$dir/log" || true
expected=$(python3 -c 'print(sum(x * x for x in range(3000)))')
grep -qx "result: $expected" "$dir/out"
grep -q "10.231.1.2:.*is lost" "$dir/log"
echo "exact result with one node's link cut: ok"
# The link comes back: a new coordinator connects to the same, never restarted, node processes.
ip netns exec "${tag}n1" ip link set "${tag}n1" up
for _ in $(seq 50); do
  ip netns exec "${tag}n1" ip link show "${tag}n1" | grep -q LOWER_UP && break
  sleep 0.1
done
# Neighbour entries that failed during the cut would refuse the first connect for a while.
ip netns exec "$coord" ip neigh flush dev "${tag}c1"
for attempt in 1 2 3; do  # the link may take a moment to pass traffic again
  if ip netns exec "$coord" "$bin" --nodes "$a,$b" --items 300 > "$dir/again" 2>&1; then break; fi
  echo "attempt $attempt: $(cat "$dir/again")"
  sleep 1
done
cat "$dir/again"
grep -qx "result: $(python3 -c 'print(sum(x * x for x in range(300)))')" "$dir/again"
echo "both nodes serve again once the link is back: ok"
