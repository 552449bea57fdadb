#!/usr/bin/env bash
# Progress of an example on stderr (examples/common/progress.hpp): with stderr not a terminal,
# plain periodic lines and a summary line, and stdout exactly as with --progress off; under a
# pseudo-terminal (util-linux `script`), a bar redrawn in place with "\r"; in tmux (what a person
# sees, capture-pane), a bar that moves, only grows and ends at 100 % with the summary. Exits 77
# (skipped) when `script` or tmux is missing, after the parts before have passed.
set -euo pipefail
bin=$1
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
# About 1.5 s: 3000 items of 1 ms on two producers; lines every 200 ms.
args=(--devices cpu,cpu --items 3000 --work-ms 1)

# 1. stderr piped through cat: plain lines (auto: the run lasts longer than the period) and the
#    summary.
"$bin" "${args[@]}" --progress-every-ms 200 2>&1 > "$dir/out" | cat > "$dir/err"
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
grep -q $'100% \\[################\\] 3000/3000' "$dir/tty" ||
  { echo "the bar does not end at 100 %:"; cat -A "$dir/tty" | tail -3; exit 1; }
echo "progress bar redrawn on a terminal: ok"

# 3. What a person sees in a terminal (tmux, capture-pane): the bar moves, its percentage only
#    grows, and the screen ends with the bar at 100 % and the summary.
if ! command -v tmux > /dev/null; then
  echo "skipped: no tmux"
  exit 77
fi
sock="$dir/tmux.sock"
# -f /dev/null: none of the user's tmux settings (default-shell, remain-on-exit) apply.
tmux -S "$sock" -f /dev/null new-session -d -x 120 -y 12 \
  "bash -c $(printf %q "$command; echo EXITED \$?; sleep 60")"
trap 'tmux -S "$sock" kill-server 2>/dev/null || true; rm -rf "$dir"' EXIT
seen=()
for _ in $(seq 1 600); do
  screen=$(tmux -S "$sock" capture-pane -p)
  pct=$(printf '%s\n' "$screen" | grep -oE '^ *[0-9]+% \[' | tail -1 | grep -oE '[0-9]+' || true)
  [ -n "$pct" ] && seen+=("$pct")
  if printf '%s\n' "$screen" | grep -q '^EXITED '; then break; fi
  sleep 0.02
done
printf '%s\n' "$screen"
printf '%s\n' "$screen" | grep -qx 'EXITED 0' || { echo "the example did not exit 0 in tmux"; exit 1; }
printf '%s\n' "$screen" | grep -qE '^100% \[#+\] 3000/3000' ||
  { echo "the screen does not end with the bar at 100 %"; exit 1; }
printf '%s\n' "$screen" | grep -qE '^done: 3000 items in [0-9.]+ s' ||
  { echo "no summary on the screen"; exit 1; }
distinct=$(printf '%s\n' "${seen[@]}" | sort -un | wc -l)
[ "$distinct" -ge 3 ] || { echo "the bar did not move: percentages seen ${seen[*]}"; exit 1; }
prev=0
for p in "${seen[@]}"; do
  [ "$p" -ge "$prev" ] || { echo "the percentage went back: ${seen[*]}"; exit 1; }
  prev=$p
done
echo "tmux: ${#seen[@]} captures, $distinct percentages, growing to 100 %, summary shown: ok"
