#!/usr/bin/env bash
# Heartbeats for a large fleet (docs/api.md, "Many members"): two nodes and a live coordinator
# with CAF's heartbeat every 500 ms (--heartbeat-ms), an idle timeout of 2 s on both sides, and
# the cluster's probes bounded to 4 a second (--probes-per-second): the result must be exact.
# A heartbeat over half the idle timeout is refused before any connection, naming the rule.
set -euo pipefail
source "$(dirname "$0")/node_lib.sh"
bin=$1
out=$(mktemp)
if "$bin" --nodes 127.0.0.1:1 --heartbeat-ms 1000 --idle-timeout-ms 1500 >"$out" 2>&1; then
  echo "a heartbeat over half the idle timeout was accepted"
  exit 1
fi
grep -q "idle_timeout must be at least twice the heartbeat" "$out" || { cat "$out"; exit 1; }
rm -f "$out"
echo "refused: idle_timeout under twice the heartbeat"
loopback_two_nodes --heartbeat-ms 500 --idle-timeout-ms 2000
"$bin" --nodes "$a,$b" --probes-per-second 4 --heartbeat-ms 500 --idle-timeout-ms 2000 \
  --items 2000 --work-ms 1 --progress off | tee "$dir/out"
expected=$(python3 -c 'print(sum(x * x for x in range(2000)))')
grep -qx "result: $expected" "$dir/out"
echo "exact result with slow heartbeats and a probe budget: ok"
