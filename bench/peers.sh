#!/usr/bin/env bash
# Installs the peers (easycore==0.4.2, ray) into their own virtual environment and prints the
# side-by-side table. Run after tools/build.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${TROUPE_PEERS_VENV:-/opt/troupe-peers}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/pip" install -q --progress-bar off easycore==0.4.2 ray
"$VENV/bin/python" bench/peers.py build/bench/troupe_bench "$@"
