#!/usr/bin/env bash
# Progress of an example on stderr (examples/common/progress.hpp): with stderr not a terminal,
# plain periodic lines and a summary line, and stdout exactly as with --progress off; under a
# pseudo-terminal (util-linux `script`), a bar redrawn in place with "\r". Exits 77 (skipped)
# when `script` is missing, after the first part has passed.
set -euo pipefail
bin=$1
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
# About 1.5 s: 3000 items of 1 ms on two producers; lines every 200 ms.
args=(--devices cpu,cpu --items 3000 --work-ms 1)

# 1. stderr to a file: plain lines (auto: the run lasts longer than the period) and the summary.
"$bin" "${args[@]}" --progress-every-ms 200 > "$dir/out" 2> "$dir/err"
"$bin" "${args[@]}" --progress off > "$dir/out_off" 2> "$dir/err_off"
cat "$dir/err"
cmp "$dir/out" "$dir/out_off" || { echo "stdout differs with progress on and off"; exit 1; }
grep -qx "result: 8995500500" "$dir/out"
[ ! -s "$dir/err_off" ] || { echo "--progress off wrote to stderr:"; cat "$dir/err_off"; exit 1; }
grep -Eq '^progress: [0-9]+/3000 items \([0-9]+%\), [0-9.]+k? items/s, .*p0 [0-9]+% p1 [0-9]+%' \
  "$dir/err" || { echo "no progress line on stderr"; exit 1; }
grep -Eqx 'done: 3000 items in [0-9.]+ s, [0-9.]+k? items/s, 2 producers' "$dir/err" ||
  { echo "no summary line on stderr"; exit 1; }
if grep -q $'\r' "$dir/err"; then echo "a bar (\\r) on a stderr that is no terminal"; exit 1; fi
lines=$(grep -c '^progress: ' "$dir/err")
# Never more often than the period: one line per 200 ms of the run at most.
most=$(awk '/^done: / { print int($5 * 1000 / 200) + 1 }' "$dir/err")
[ "$lines" -le "$most" ] || { echo "$lines progress lines: more often than the period"; exit 1; }
# A short run prints nothing on stderr in auto mode (the other tests' output stays as it was).
"$bin" --devices cpu,cpu --items 100 > "$dir/short" 2> "$dir/short_err"
[ ! -s "$dir/short_err" ] || { echo "a short run wrote to stderr:"; cat "$dir/short_err"; exit 1; }
echo "plain progress lines and summary on stderr, stdout unchanged: ok"

# 2. stderr a pseudo-terminal: the bar, redrawn with "\r" and cleared to the end of the line.
if ! command -v script > /dev/null; then
  echo "skipped: no util-linux script for a pseudo-terminal"
  exit 77
fi
printf -v command '%q ' "$bin" "${args[@]}"
script -qfc "$command" /dev/null < /dev/null > "$dir/tty"
grep -q $'\r\e\[K *[0-9]*% \[#* *\] [0-9]*/3000' "$dir/tty" ||
  { echo "no bar redrawn in place:"; cat -A "$dir/tty"; exit 1; }
[ "$(grep -o $'\r\e\[K' "$dir/tty" | wc -l)" -ge 3 ] || { echo "the bar was not redrawn"; exit 1; }
grep -q 'done: 3000 items in [0-9.]* s' "$dir/tty" || { echo "no summary on the terminal"; exit 1; }
grep -q 'result: 8995500500' "$dir/tty"
echo "progress bar redrawn on a terminal: ok"
