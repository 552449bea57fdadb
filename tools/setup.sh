#!/usr/bin/env bash
# Installs everything troupe needs on a fresh Debian 12 machine (run as root):
# Debian packages, CAF 0.17.6 rebuilt from Debian's source package with troupe's patches
# (tools/build_caf.sh: /opt/troupe-caf-<hash of the patches>, reused when already there), and
# LibTorch (the pinned PyPI torch wheel) in a virtual environment kept outside the clone
# ($TROUPE_VENV, default /opt/troupe-venv), reused when already there.
# Prints nothing else on success but progress lines; safe to run again.
set -euo pipefail
TORCH_VERSION=2.15.0
VENV=${TROUPE_VENV:-/opt/troupe-venv}
K8S_VALIDATE_VERSION=1.37.0
K8S_VENV=${TROUPE_K8S_VENV:-/opt/troupe-k8s-venv}

# No libcaf-dev: troupe builds against its patched CAF (its build needs cmake, g++, libssl-dev,
# and dpkg-dev for apt-get source).
packages=(build-essential cmake git python3 python3-venv dpkg-dev libcli11-dev libgtest-dev
          libgmock-dev libbenchmark-dev libtbb-dev libssl-dev openssl iproute2 prometheus-cpp-dev
          pkg-config libboost1.81-dev systemd chromium python3-jsonschema tmux python3-dev ccache)
missing=()
for p in "${packages[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  apt-get install -y -q "${missing[@]}"
fi

# promtool (checks the metrics' text in the tests) from Debian's prometheus package, unpacked
# into /opt/troupe-promtool rather than installed: installing it would start a Prometheus server.
if ! command -v promtool >/dev/null && [ ! -x /opt/troupe-promtool/usr/bin/promtool ]; then
  echo "setup: unpacking promtool from Debian's prometheus package into /opt/troupe-promtool"
  tmp=$(mktemp -d)
  (cd "$tmp" && apt-get download -q prometheus >/dev/null) || { apt-get update -q && (cd "$tmp" && apt-get download -q prometheus >/dev/null); }
  dpkg-deb -x "$tmp"/prometheus_*.deb /opt/troupe-promtool
  rm -rf "$tmp"
fi

echo "setup: CAF with troupe's patches in $("$(dirname "$0")/build_caf.sh" | tail -n 1)"

if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
  echo "setup: installing torch==$TORCH_VERSION into $VENV (several GB, once)"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --progress-bar off "torch==$TORCH_VERSION"
fi
# Debian's CAF and GoogleTest use the new libstdc++ ABI: the wheel must too.
"$VENV/bin/python" -c "import torch, sys; sys.exit(0 if torch._C._GLIBCXX_USE_CXX11_ABI else 'torch wheel uses the old C++ ABI')" 2>/dev/null

# kubernetes-validate (PyPI) checks deploy/kubernetes/ in the tests (tests/deploy_kubernetes.sh).
if [ ! -x "$K8S_VENV/bin/kubernetes-validate" ]; then
  echo "setup: installing kubernetes-validate==$K8S_VALIDATE_VERSION into $K8S_VENV"
  python3 -m venv "$K8S_VENV"
  "$K8S_VENV/bin/pip" install -q --progress-bar off "kubernetes-validate==$K8S_VALIDATE_VERSION"
fi
echo "setup: done"
