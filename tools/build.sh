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
# ccache (tools/setup.sh installs it) keeps compiled objects outside the clone, in
# $TROUPE_CCACHE_DIR (default /opt/troupe-ccache), as the torch environment and CAF are kept: a
# fresh clone on a machine that built troupe before compiles only what changed. Paths are
# hashed relative to the clone (base_dir) and not by its directory (hash_dir), so another
# clone's objects are reused. TROUPE_CCACHE=0 builds without it.
launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER= -DCMAKE_C_COMPILER_LAUNCHER=)
if [ "${TROUPE_CCACHE:-1}" != 0 ] && command -v ccache >/dev/null; then
  # In the launcher itself, so that a later `cmake --build` of this folder uses the same cache.
  cc="env;CCACHE_DIR=${TROUPE_CCACHE_DIR:-/opt/troupe-ccache};CCACHE_BASEDIR=$PWD;CCACHE_NOHASHDIR=1"
  cc="$cc;CCACHE_MAXSIZE=${CCACHE_MAXSIZE:-8G};ccache"
  launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER="$cc" -DCMAKE_C_COMPILER_LAUNCHER="$cc")
fi
cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=${BUILD_TYPE:-Release} "${launcher[@]}" \
  -DTROUPE_CAF_PREFIX="$caf_prefix" \
  ${torch_prefix:+-DCMAKE_PREFIX_PATH="$torch_prefix" -DCMAKE_LIBRARY_PATH="$torch_libs"} \
  "$@" > "$BUILD_DIR.configure.log" 2>&1 ||
  { cat "$BUILD_DIR.configure.log"; exit 1; }
grep -A3 "troupe:" "$BUILD_DIR.configure.log" || true
# TARGETS: only these targets (space-separated), e.g. for the sanitizer build of CI.
cmake --build "$BUILD_DIR" -j "${JOBS:-2}" ${TARGETS:+--target $TARGETS}
