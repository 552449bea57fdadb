#!/usr/bin/env bash
# The main job: sets up, builds, and runs the sum_of_squares demo on local CPU producers, then
# the inference demo and a short data-parallel training run (troupe::torch) on CPU devices.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh
tools/build.sh
build/examples/sum_of_squares --devices cpu,cpu,cpu --items 100000 --work-ms 0
if [ -x build/examples/inference ]; then
  devices=cpu,cpu
  build/examples/inference --devices "$devices" --items 256
fi
if [ -x build/examples/train ]; then
  build/examples/train --devices cpu,cpu --epochs 2 --samples 4000
fi
