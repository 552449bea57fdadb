#!/usr/bin/env bash
# BENCHMARKS.md "Real models on CPU producers": exports the ResNet-style CNN once (.pt), then
# runs troupe (build/bench/troupe_model_bench) and its Python peers (bench/model_peers.py:
# the loop, a torch.multiprocessing Pool, easycore 0.4.2) over the same images, one after the
# other. easycore goes into a venv of its own ($TROUPE_PEERS_TORCH_VENV, default
# /opt/troupe-peers-torch) and runs with the project's torch venv on its path; troupe never
# depends on it. Run after tools/build.sh.
#   bench/model_peers.sh [--per-item 1] [--images 1024]
set -euo pipefail
cd "$(dirname "$0")/.."
torch_venv=${TROUPE_VENV:-/opt/troupe-venv}
peers=${TROUPE_PEERS_TORCH_VENV:-/opt/troupe-peers-torch}
[ -x "$peers/bin/python" ] || python3 -m venv "$peers"
"$peers/bin/pip" install -q --progress-bar off easycore==0.4.2
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
"$torch_venv/bin/python" examples/export_model.py "$dir/r.pt" --channels 3 --side 32 --width 32 \
  --blocks 4 --references 1 > /dev/null
per_item=1 images=1024
while [ $# -gt 0 ]; do
  case $1 in
    --per-item) per_item=$2; shift 2 ;;
    --images) images=$2; shift 2 ;;
    *) echo "usage: $0 [--per-item N] [--images N]" >&2; exit 2 ;;
  esac
done
build/bench/troupe_model_bench --model "$dir/r.pt" --inputs 3072 --images "$images" \
  --per-item "$per_item" --threads 1 2
site=$(echo "$peers"/lib/python3*/site-packages)
PYTHONPATH=$site "$torch_venv/bin/python" bench/model_peers.py "$dir/r.pt" --images "$images" \
  --per-item "$per_item"
