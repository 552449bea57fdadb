#!/usr/bin/env bash
# serve --model FILE.pt: a small ResNet-style CNN exported from Python at test time
# (examples/export_model.py, with the project's venv), served by 2 CPU producers that share one
# loaded copy (device_state) and warm it up; the reference rows Python computed must come back
# from the C++ side, and every one of the self-test's answers is checked.
set -euo pipefail
serve=$1
exporter=$2
python=${TROUPE_VENV:-/opt/troupe-venv}/bin/python
if ! "$python" -c 'import torch' 2>/dev/null; then
  echo "skipped: no torch in $python (tools/setup.sh installs it)"
  exit 77
fi
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
"$python" "$exporter" "$dir/tiny.pt" --width 8 --references 8
"$serve" --listen 127.0.0.1:0 --devices cpu,cpu --model "$dir/tiny.pt" --requests 300 \
  --concurrency 16 --max-batch 16 --max-delay-us 500 > "$dir/out" 2> "$dir/err" ||
  { cat "$dir/err"; exit 1; }
cat "$dir/err" "$dir/out"
grep -q "reference: $dir/tiny.pt gives Python's scores on 8 rows" "$dir/err"
grep -q "model loaded 1 time(s)" "$dir/err"
grep -q "0 wrong" "$dir/err"
grep -Eq "^result: [0-9]+$" "$dir/out"
echo "TorchScript model served: ok"
