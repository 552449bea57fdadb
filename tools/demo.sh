#!/usr/bin/env bash
# The main job: sets up, builds, and runs the sum_of_squares demo on local CPU producers, then
# the inference demo and a short data-parallel training run (troupe::torch) on CPU devices.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh
# Only what the demos run (tools/test.sh builds the rest in the same build folder).
TARGETS=sum_of_squares tools/build.sh
# troupe::torch's examples, when LibTorch was found. (The target list is read whole first: piped
# into grep -q it would be cut short, and pipefail would count that as a failure.)
targets=$(cmake --build build --target help 2>/dev/null || true)
for t in inference train; do
  if grep -q "^\.\.\. $t\$" <<< "$targets"; then
    cmake --build build -j "${JOBS:-2}" --target "$t"
  fi
done
build/examples/sum_of_squares --devices cpu,cpu,cpu --items 100000 --work-ms 0
if [ -x build/examples/inference ]; then
  devices=cpu,cpu
  build/examples/inference --devices "$devices" --items 256
fi
if [ -x build/examples/train ]; then
  build/examples/train --devices cpu,cpu --epochs 2 --samples 4000
fi
