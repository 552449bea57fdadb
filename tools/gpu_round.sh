#!/usr/bin/env bash
# The whole GPU round in one call of the device tool (its machine returns only what is under
# $OUT, and a call cut at its limit returns what is there by then): tools/offline_gpu.sh's
# stages one after another, each stage's log copied to $OUT as soon as it ends.
#
#   here:  tools/offline_gpu.sh pack .gpu          (and /.gpu/ in .git/info/exclude, carried)
#   there: tools/gpu_round.sh .gpu                  STAGES="build model" TARGETS=serve ... too
#
# Default stages: build model serve train test bench (REPEAT=1 for the bench: ~400 s in all on
# an H200 machine with 16 cores, the build of everything ~110 s of it).
set -u
dir=${1:?usage: tools/gpu_round.sh DIR (from tools/offline_gpu.sh pack DIR)}
cd "$(dirname "$0")/.." || exit 1
R=${OUT:?OUT: the folder whose files come back}
export OUT=/tmp/troupe-gpu-round
mkdir -p "$OUT"
t0=$(date +%s)
lap() {
  echo "== $1 done at $(($(date +%s) - t0)) s"
  shift
  for f in "$@"; do [ -f "$OUT/$f" ] && cp "$OUT/$f" "$R/"; done
}
for s in ${STAGES:-build model serve train test bench}; do
  case $s in
    build)
      if ! tools/offline_gpu.sh build "$dir" build; then
        cp "$OUT/build.log" "$OUT/configure.log" "$R/" 2>/dev/null
        lap build env.txt
        exit 1
      fi
      lap build env.txt
      ;;
    model | serve | train) tools/offline_gpu.sh build "$dir" "$s"; lap "$s" "$s.log" ;;
    test) tools/offline_gpu.sh build "$dir" test; lap test ctest.log ;;
    bench) REPEAT=${REPEAT:-1} tools/offline_gpu.sh build "$dir" bench; lap bench bench.log ;;
    *) echo "unknown stage $s" >&2; exit 2 ;;
  esac
done
