#!/usr/bin/env bash
# deploy/troupe-node.service passes `systemd-analyze verify` (no warning either) with ExecStart
# pointing at a real node program, and stops later than the node's drain deadline.
set -euo pipefail
unit=$1
program=$2
if ! command -v systemd-analyze >/dev/null; then
  echo "skipped: systemd-analyze is not installed"
  exit 77
fi
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
sed "s|^ExecStart=/usr/local/bin/troupe-node|ExecStart=$program|" "$unit" > "$dir/troupe-node.service"
grep -q "^ExecStart=$program " "$dir/troupe-node.service"
out=$(cd "$dir" && systemd-analyze verify ./troupe-node.service 2>&1) || { echo "$out"; exit 1; }
# The unit's own lines only (systemd may say things about the host's units, e.g. in a container)
if echo "$out" | grep "troupe-node.service"; then
  echo "systemd-analyze verify warned about the unit"
  exit 1
fi
stop=$(sed -n 's/^TimeoutStopSec=\([0-9]*\)$/\1/p' "$unit")
drain_ms=$(sed -n 's/.*--drain-timeout-ms \([0-9]*\).*/\1/p' "$unit")
[ -n "$stop" ] && [ -n "$drain_ms" ] || { echo "TimeoutStopSec or --drain-timeout-ms missing"; exit 1; }
if [ $((stop * 1000)) -le "$drain_ms" ]; then
  echo "TimeoutStopSec=${stop}s is not above the drain deadline (${drain_ms} ms)"
  exit 1
fi
echo "systemd-analyze verify: clean; TimeoutStopSec ${stop} s > drain ${drain_ms} ms"
