# Sourced by the serve tests (cli_serve.sh, serve_torchscript.sh), which set $dir and $pid.
# start COMMAND...: the server in the background (stderr in $dir/err, stdout in $dir/out); sets
# pid and port once it says it serves.
start() {
  "$@" 2> "$dir/err" > "$dir/out" &
  pid=$!
  for _ in $(seq 300); do grep -q "serving HTTP on" "$dir/err" && break; sleep 0.1; done
  port=$(sed -n 's/serving HTTP on 127.0.0.1:\([0-9]*\).*/\1/p' "$dir/err")
  [ -n "$port" ] || { cat "$dir/err"; exit 1; }
}
# stop: SIGTERM, and it must exit 0.
stop() {
  kill -TERM "$pid"
  local rc=0
  wait "$pid" || rc=$?
  pid=
  [ "$rc" -eq 0 ] || { echo "serve exited $rc on SIGTERM"; cat "$dir/err"; exit 1; }
}
