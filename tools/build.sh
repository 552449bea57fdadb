#!/usr/bin/env bash
# Configures and builds troupe into ${BUILD_DIR:-build} against the LibTorch of tools/setup.sh.
# Extra arguments go to CMake (e.g. -DTROUPE_SANITIZE=ON -DTROUPE_WITH_TORCH=OFF).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${TROUPE_VENV:-/opt/troupe-venv}
BUILD_DIR=${BUILD_DIR:-build}
torch_prefix=$("$VENV/bin/python" -c 'import torch; print(torch.utils.cmake_prefix_path)' 2>/dev/null || true)
# The wheel's TorchConfig looks for libc10 in the system paths first: a Debian libtorch-dev
# there would be mixed in. Search the wheel's own lib folder first.
torch_libs=${torch_prefix:+$(dirname "$(dirname "$torch_prefix")")/lib}
cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=${BUILD_TYPE:-Release} \
  ${torch_prefix:+-DCMAKE_PREFIX_PATH="$torch_prefix" -DCMAKE_LIBRARY_PATH="$torch_libs"} \
  "$@" > "$BUILD_DIR.configure.log" 2>&1 ||
  { cat "$BUILD_DIR.configure.log"; exit 1; }
grep "troupe:" "$BUILD_DIR.configure.log" || true
cmake --build "$BUILD_DIR" -j "${JOBS:-2}"
