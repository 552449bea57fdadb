#!/usr/bin/env bash
# Configures and builds troupe into ${BUILD_DIR:-build} against the LibTorch of tools/setup.sh
# and the patched CAF of tools/build_caf.sh (built first if missing; TROUPE_CAF_PREFIX
# overrides, TROUPE_CAF_PREFIX=system uses the system's CAF without troupe's patches).
# Extra arguments go to CMake (e.g. -DTROUPE_SANITIZE=ON -DTROUPE_WITH_TORCH=OFF); TARGETS limits
# what is built.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${TROUPE_VENV:-/opt/troupe-venv}
BUILD_DIR=${BUILD_DIR:-build}
if [ "${TROUPE_CAF_PREFIX:-}" = system ]; then
  caf_prefix=
else
  caf_prefix=$(tools/build_caf.sh | tail -n 1)
fi
torch_prefix=$("$VENV/bin/python" -c 'import torch; print(torch.utils.cmake_prefix_path)' 2>/dev/null || true)
# The wheel's TorchConfig looks for libc10 in the system paths first: a Debian libtorch-dev
# there would be mixed in. Search the wheel's own lib folder first.
torch_libs=${torch_prefix:+$(dirname "$(dirname "$torch_prefix")")/lib}
cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=${BUILD_TYPE:-Release} \
  -DTROUPE_CAF_PREFIX="$caf_prefix" \
  ${torch_prefix:+-DCMAKE_PREFIX_PATH="$torch_prefix" -DCMAKE_LIBRARY_PATH="$torch_libs"} \
  "$@" > "$BUILD_DIR.configure.log" 2>&1 ||
  { cat "$BUILD_DIR.configure.log"; exit 1; }
grep -A3 "troupe:" "$BUILD_DIR.configure.log" || true
# TARGETS: only these targets (space-separated), e.g. for the sanitizer build of CI.
cmake --build "$BUILD_DIR" -j "${JOBS:-2}" ${TARGETS:+--target $TARGETS}
