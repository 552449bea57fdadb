#!/usr/bin/env bash
# Sets up, builds and runs the whole test suite (GPU tests skip, with the reason, without a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh
tools/build.sh
ctest --test-dir build --output-on-failure -j 2 --timeout 300
