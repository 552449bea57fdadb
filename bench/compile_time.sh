#!/usr/bin/env bash
# CPU time (user + system) to compile bench/trivial_job.cpp against troupe's public headers of
# each git revision given (default: the one before the package split, and HEAD), with the flags a
# Release build of a user's project uses (g++ -std=c++17 -O2), 5 times each; prints each run, the
# median, and the preprocessed size.
#   bench/compile_time.sh [REV ...]
set -euo pipefail
cd "$(dirname "$0")/.."
revs=("$@")
[ ${#revs[@]} -gt 0 ] || revs=(4d1c741 HEAD)
caf=$(tools/build_caf.sh | tail -n 1)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for rev in "${revs[@]}"; do
  dir=$tmp/$rev
  mkdir -p "$dir"
  git archive "$rev" messages/include nodes/include actors/include | tar -x -C "$dir"
  flags=(-std=c++17 -O2 -w -I"$dir/actors/include" -I"$dir/nodes/include" -I"$dir/messages/include"
         -isystem "$caf/include")
  lines=$(g++ "${flags[@]}" -E bench/trivial_job.cpp | wc -l)
  times=()
  for _ in 1 2 3 4 5; do
    t=$( { /usr/bin/time -f "%U %S" g++ "${flags[@]}" -c bench/trivial_job.cpp -o "$tmp/t.o"; } 2>&1 |
         awk '{printf "%.2f", $1 + $2}')
    times+=("$t")
  done
  median=$(printf "%s\n" "${times[@]}" | sort -n | sed -n 3p)
  echo "$rev: ${times[*]} s CPU; median $median s; $lines preprocessed lines"
done
