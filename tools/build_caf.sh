#!/usr/bin/env bash
# Builds CAF 0.17.6 (libcaf_core, libcaf_io, libcaf_openssl only; Release) from Debian's
# source package with troupe's patch series (third_party/caf/patches, see the README there)
# and installs it into a prefix outside the clone keyed by a hash of that series:
# /opt/troupe-caf-<hash> ($TROUPE_CAF_PREFIX overrides). Reused when already there.
# Prints the prefix on its last line. Needs deb-src for bookworm (added here if missing),
# dpkg-dev, cmake, g++ and libssl-dev (tools/setup.sh installs them).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
patches=$root/third_party/caf/patches
version=0.17.6
orig_sha256=e2bf5bd243f08bb7d8adde197cfe3e6d71314ed3378fe0692f8932f4c3b3928c
# The key covers the patches, the version and this script's build settings.
key=$( (echo "$version $orig_sha256"; cat "$patches"/*.patch; sed -n '/^# -- build settings/,$p' "$0") |
       sha256sum | cut -c1-12)
prefix=${TROUPE_CAF_PREFIX:-/opt/troupe-caf-$key}
if [ -f "$prefix/.troupe-caf-complete" ]; then
  echo "build_caf: patched CAF already in $prefix" >&2
  echo "$prefix"
  exit 0
fi
work=$(mktemp -d /tmp/troupe-caf.XXXXXX)
trap 'rm -rf "$work"' EXIT
start=$(date +%s)

# -- source: Debian's actor-framework source package (the orig tarball, checked) --------------
if ! grep -rqs '^Types:.*deb-src' /etc/apt/sources.list.d/ && ! grep -qs '^deb-src' /etc/apt/sources.list; then
  echo "build_caf: adding deb-src entries for bookworm" >&2
  cat > /etc/apt/sources.list.d/troupe-deb-src.sources <<'SRC'
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb-src
URIs: http://deb.debian.org/debian-security
Suites: bookworm-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
  apt-get update -q >&2
fi
cd "$work"
# --download-only: the Debian tarball (debian/ and its patches) may be missing on a mirror
# (it was on ours); the orig tarball is what we need, and it must be the one we checked.
apt-get source --download-only "actor-framework=$version-2.1" >&2 || true
tarball=actor-framework_$version.orig.tar.gz
[ -f "$tarball" ] || { echo "build_caf: cannot download $tarball (deb-src, apt-get source)" >&2; exit 1; }
echo "$orig_sha256  $tarball" | sha256sum -c --quiet - >&2
tar xzf "$tarball"
src=$work/actor-framework-$version
debian=(actor-framework_"$version"-*.debian.tar.xz)
if [ -f "${debian[0]}" ]; then
  # Debian's own patches first, when its tarball is there.
  tar xJf "${debian[0]}" -C "$src"
  if [ -f "$src/debian/patches/series" ]; then
    while read -r p; do
      [ -n "$p" ] && [ "${p#\#}" = "$p" ] || continue
      patch -d "$src" -p1 --forward -s < "$src/debian/patches/$p" >&2 ||
        echo "build_caf: Debian patch $p did not apply cleanly (see third_party/caf/README.md)" >&2
    done < "$src/debian/patches/series"
  fi
fi
for p in "$patches"/*.patch; do
  echo "build_caf: applying $(basename "$p")" >&2
  patch -d "$src" -p1 --forward -s < "$p" >&2
done

# -- build settings (part of the prefix key) ---------------------------------------------------
cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_CXX_FLAGS="-std=c++17 -Wno-deprecated-declarations" \
  -DCAF_NO_EXAMPLES=yes -DCAF_NO_TOOLS=yes -DCAF_NO_UNIT_TESTS=yes -DCAF_NO_PYTHON=yes \
  -DCAF_NO_OPENCL=yes -DCAF_NO_SUMMARY=yes -DCAF_NO_COMPILER_CHECK=yes \
  -DCMAKE_INSTALL_PREFIX="$prefix" -DCMAKE_INSTALL_LIBDIR=lib \
  -DCMAKE_INSTALL_RPATH="$prefix/lib" >&2
cmake --build "$work/build" -j "${JOBS:-2}" >&2
rm -rf "$prefix"
cmake --install "$work/build" >&2
rm -rf "$prefix/share/doc"
cp -r "$patches" "$prefix/troupe-patches"
touch "$prefix/.troupe-caf-complete"
echo "build_caf: built and installed into $prefix in $(( $(date +%s) - start )) s" >&2
echo "$prefix"
