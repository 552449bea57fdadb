#!/usr/bin/env bash
# Training benchmarks side by side in one run (BENCHMARKS.md, "Training"): troupe's gradient
# reduction against gloo allreduce between as many processes, the train model's steps/s against
# PyTorch DDP (gloo, CPU), the cost of --deterministic, and the time from a replica's loss to the
# step's completion. Run after tools/build.sh (BUILD_DIR, default build).
set -euo pipefail
cd "$(dirname "$0")/.."
bench=${BUILD_DIR:-build}/bench/troupe_train_bench
py=${TROUPE_VENV:-/opt/troupe-venv}/bin/python
for n in 2 4; do
  "$py" bench/train_peers.py allreduce --procs "$n" --mib 1 16 64 --iters 10 || echo "gloo allreduce failed"
  "$bench" reduce --replicas "$n" --mib 1 16 64 --iters 10
  "$bench" reduce --replicas "$n" --mib 1 16 64 --iters 10 --nodes
  "$bench" reduce --replicas "$n" --mib 1 16 64 --iters 10 --nodes --caf-ring
done
for n in 1 2 4; do
  "$py" bench/train_peers.py ddp --procs "$n" --steps 300 --batch 64 --threads 1 || echo "ddp failed"
  "$bench" model --replicas "$n" --steps 300 --batch 64 --shard $((64 / n))
  [ "$n" = 1 ] || "$bench" model --replicas "$n" --steps 300 --batch 64 --shard $((64 / n)) --nodes
done
"$bench" loss
