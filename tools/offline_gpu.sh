#!/usr/bin/env bash
# Builds and tests troupe on a machine that has CUDA and a CUDA LibTorch (python3's torch) but
# no network, e.g. a rented GPU machine, from what a Debian 12 machine set up by tools/setup.sh
# has. (How the GPU runs of BENCHMARKS.md, "On a GPU", were made.)
#
#   tools/offline_gpu.sh pack DIR            # here: patched CAF, GoogleTest, CLI11, oneTBB,
#                                            # OpenSSL headers into DIR (a few MB)
#   tools/offline_gpu.sh build DIR [STAGES]  # there, in a copy of the checkout holding DIR:
#                                            # STAGES of: build test bench serve model train
#                                            # (default: build test bench)
#
# `build` puts the build in build/ and the logs in ${OUT:-/tmp/troupe-gpu}. TARGETS="a b" builds
# only those targets; CTEST_ARGS="-R regex" runs only those tests; REPEAT (default 3) is the
# inference bench's --repeat.
set -uo pipefail
cd "$(dirname "$0")/.."
cmd=${1:-}
dir=${2:-}
[ -n "$cmd" ] && [ -n "$dir" ] || { sed -n '2,12p' "$0"; exit 2; }

if [ "$cmd" = pack ]; then
  set -e
  mkdir -p "$dir"
  caf=$(tools/build_caf.sh | tail -n 1)
  for p in libgtest-dev libgmock-dev libcli11-dev libtbb-dev libtbb12 libtbbmalloc2 \
           libtbbbind-2-5 libhwloc15 libssl-dev libssl3 libboost1.81-dev; do
    dpkg -L "$p"
  done | while read -r f; do [ -f "$f" ] || [ -L "$f" ] && echo "${f#/}"; done |
    grep -v 'share/doc\|share/man\|lib\(ssl\|crypto\)\.a$\|engines-3\|ossl-modules' |
    grep -v '^usr/src' | sort -u > "$dir/deps.list"
  tar czf "$dir/deps.tgz" -C / -T "$dir/deps.list"
  tar czf "$dir/caf.tgz" -C "$(dirname "$caf")" "$(basename "$caf")"
  echo "$caf" > "$dir/caf.prefix"
  ls -la "$dir"
  exit 0
fi
[ "$cmd" = build ] || { echo "unknown command $cmd" >&2; exit 2; }

stages=" ${*:3} "
[ "$stages" = "  " ] && stages=" build test bench "
out=${OUT:-/tmp/troupe-gpu}
mkdir -p "$out"
py=$(command -v python3)
caf=$(cat "$dir/caf.prefix")
if [ ! -d /tmp/troupe-deps/usr ]; then
  {
    nproc; nvidia-smi -L; g++ --version | head -1; cmake --version | head -1
    /usr/local/cuda/bin/nvcc --version | tail -1
    "$py" -c 'import torch; print(torch.__version__, torch.cuda.is_available())'
  } > "$out/env.txt" 2>&1
  mkdir -p /tmp/troupe-deps && tar xzf "$dir/deps.tgz" -C /tmp/troupe-deps
  # The prefix is baked into CAF's RUNPATH: it goes back where it was built.
  mkdir -p "$(dirname "$caf")" && tar xzf "$dir/caf.tgz" -C "$(dirname "$caf")"
fi
export PATH=/usr/local/cuda/bin:$PATH
export LD_LIBRARY_PATH=/tmp/troupe-deps/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
torch_prefix=$("$py" -c 'import torch; print(torch.utils.cmake_prefix_path)')
ssl=()
[ -f /usr/include/openssl/ssl.h ] || ssl=(-DOPENSSL_ROOT_DIR=/tmp/troupe-deps/usr)
if [[ $stages == *" build "* ]]; then
  if [ ! -f build/CMakeCache.txt ]; then
    cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DTROUPE_CAF_PREFIX="$caf" \
      -DCMAKE_PREFIX_PATH="$torch_prefix;/tmp/troupe-deps/usr" \
      -DCMAKE_LIBRARY_PATH="$(dirname "$(dirname "$torch_prefix")")/lib" \
      -DCUDAToolkit_ROOT=/usr/local/cuda "${ssl[@]}" > "$out/configure.log" 2>&1 ||
      { tail -40 "$out/configure.log"; exit 1; }
    grep -A1 "troupe:" "$out/configure.log"
  fi
  # shellcheck disable=SC2086
  cmake --build build -j "$(nproc)" ${TARGETS:+--target $TARGETS} >> "$out/build.log" 2>&1 ||
    { grep -E "error" "$out/build.log" | head -30; exit 1; }
  grep -E "warning: " "$out/build.log" | head -20
fi
if [[ $stages == *" test "* ]]; then
  # shellcheck disable=SC2086
  ctest --test-dir build --output-on-failure -j 8 --timeout 300 ${CTEST_ARGS:-} >> "$out/ctest.log" 2>&1
  echo "ctest exit status $?"
  grep -E "tests passed|\(Failed\)|\(SEGFAULT\)|\(Timeout\)" "$out/ctest.log"
fi
if [[ $stages == *" bench "* ]]; then
  for a in "400 256 2048" "2000 32 512" "100 4096 4096"; do
    set -- $a
    build/bench/troupe_inference_bench --devices cuda:0 cuda:0,cuda:0 cuda:0,cuda:0,cuda:0,cuda:0 \
      --batches "$1" --rows "$2" --width "$3" --layers 4 --repeat "${REPEAT:-3}"
  done 2>&1 | tee "$out/bench.log"
fi
if [[ $stages == *" serve "* ]]; then
  # examples/serve with its LibTorch MLP on the GPU: 64 connections of 1-request jobs, with and
  # without batching, on 1 and 2 producers (each answer checked against the model on the CPU).
  for d in cuda:0 cuda:0,cuda:0; do
    for b in "64 1000" "16 500" "0 0"; do
      set -- $b
      echo "== serve --devices $d --model mlp --hidden 1024 --layers 4 --max-batch $1 --max-delay-us $2"
      build/examples/serve --listen 127.0.0.1:0 --devices "$d" --model mlp --hidden 1024 \
        --layers 4 --requests 20000 --concurrency 64 --max-batch "$1" --max-delay-us "$2" 2>&1 |
        grep -v "serving HTTP"
    done
  done 2>&1 | tee "$out/serve.log"
fi
if [[ $stages == *" model "* ]]; then
  # A real model from a file on the GPU: examples/export_model.py's CNN (3x16x16 images, width
  # 256, 4 blocks: about 19 MB of weights) served from its .pt on 1 and 2 producers of cuda:0,
  # which share one loaded copy (the serve example's device_state): serve says how many times
  # the model was loaded, and the GPU's used memory is sampled while it serves (one copy: the
  # second producer adds its stream's workspace, not another 19 MB of weights). Every answer is
  # checked against the same model run on the CPU.
  "$py" examples/export_model.py "$out/cnn.pt" --channels 3 --side 16 --width 256 --blocks 4 \
    > "$out/model.log" 2>&1
  for d in cuda:0 cuda:0,cuda:0; do
    for b in "64 1000" "0 0"; do
      set -- $b
      echo "== serve --model cnn.pt --devices $d --max-batch $1 --max-delay-us $2"
      nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 100 > "$out/mem.txt" &
      smi=$!
      build/examples/serve --listen 127.0.0.1:0 --devices "$d" --model "$out/cnn.pt" \
        --requests 2000 --concurrency 64 --max-batch "$1" --max-delay-us "$2" 2>&1 |
        grep -v "serving HTTP"
      kill "$smi"; wait "$smi" 2>/dev/null
      echo "GPU memory used, MiB: idle $(head -n 1 "$out/mem.txt"), most $(sort -n "$out/mem.txt" | tail -n 1)"
    done
  done 2>&1 | tee -a "$out/model.log"
fi
if [[ $stages == *" train "* ]]; then
  # The train example on the GPU: 1, 2 and 4 replicas on cuda:0, plain and --deterministic
  # (whose parameters must not depend on the number of replicas), and the same on the CPU.
  for d in cuda:0 cuda:0,cuda:0 cuda:0,cuda:0,cuda:0,cuda:0 cpu,cpu; do
    for m in "" --deterministic; do
      echo "== train --devices $d $m --hidden 1024 --samples 40000 --batch 256 --shard 64"
      s0=$(date +%s.%N)
      build/examples/train --devices "$d" $m --hidden 1024 --samples 40000 --batch 256 --shard 64 \
        --epochs 2 --progress off 2>&1 | grep -E "params|result|epoch 2|rror"
      awk -v a="$s0" -v b="$(date +%s.%N)" 'BEGIN { printf "wall %.2f s\n", b - a }'
    done
  done 2>&1 | tee "$out/train.log"
fi
