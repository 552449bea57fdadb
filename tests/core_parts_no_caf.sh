#!/bin/sh
# Usage: core_parts_no_caf.sh COMPILER "DIR;DIR;..." SOURCE
# Compiles SOURCE (tests/core_parts_check.cpp) with the library's include directories, CAF's
# among them, and fails when any header it reaches is one of CAF's: the scheduler's parts must
# not depend on the actor framework.
set -eu
cxx=$1
source=$3
flags=
old_ifs=$IFS
IFS=';'
for d in $2; do if [ -n "$d" ]; then flags="$flags -I$d"; fi; done
IFS=$old_ifs
# shellcheck disable=SC2086
$cxx -std=c++17 -fsyntax-only $flags "$source"
# shellcheck disable=SC2086
deps=$($cxx -std=c++17 -M $flags "$source" | tr ' \\' '\n\n' | grep -E '/caf/' || true)
if [ -n "$deps" ]; then
  echo "the scheduler's parts include CAF headers:"
  echo "$deps" | sort -u | head -20
  exit 1
fi
echo "no CAF header among $($cxx -std=c++17 -M $flags "$source" | tr ' \\' '\n\n' | grep -c '\.h') headers"
