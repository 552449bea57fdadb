#!/usr/bin/env bash
# Starts the Ray Serve peer (ray_app.py) on 127.0.0.1, waits until POST /predict answers, and
# stops it again. Ray runs as a local instance owned by one Python process (the driver), so
# stopping that process by its PID shuts Serve and every Ray process of it down (serve.shutdown,
# ray.shutdown): what `ray stop` does, without touching any other Ray on the machine.
#
#   bench/peers_serve/run_ray.sh start [PORT]   # background; prints the driver's PID
#   bench/peers_serve/run_ray.sh stop  [PORT]   # SIGINT to that PID, waits for it to exit
#   bench/peers_serve/run_ray.sh fg    [PORT]   # foreground until Ctrl-C
#   bench/peers_serve/run_ray.sh ray-stop       # `ray stop`: every Ray process on this machine
#
# Installs Ray Serve into $TROUPE_RAY_VENV (default /opt/troupe-bench-ray) when it is missing.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
VENV=${TROUPE_RAY_VENV:-/opt/troupe-bench-ray}
RAY_VERSION=${TROUPE_RAY_VERSION:-2.60.0}
CMD=${1:-fg}
PORT=${2:-8000}
PIDFILE=${TMPDIR:-/tmp}/troupe-bench-ray.$PORT.pid
LOG=${TMPDIR:-/tmp}/troupe-bench-ray.$PORT.log
BODY=${TROUPE_RAY_BODY:-0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,1.0,1.1,1.2,1.3,1.4,1.5,1.6}
# More arguments for ray_app.py (--model FILE.pt --inputs N --replicas 2, say).
read -r -a APP_ARGS <<<"${TROUPE_RAY_ARGS:-}"
export RAY_USAGE_STATS_ENABLED=0

install() {
  [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
  "$VENV/bin/python" -c "import ray.serve" 2>/dev/null ||
    "$VENV/bin/pip" install -q --progress-bar off "ray[serve]==$RAY_VERSION"
  # --model needs torch: the project's own (tools/setup.sh), after the venv's packages.
  local site; site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  local torch_site=${TROUPE_VENV:-/opt/troupe-venv}/lib/python3.11/site-packages
  [ -d "$torch_site" ] && echo "$torch_site" >"$site/troupe_torch.pth"
  return 0
}

answers() {
  curl -sf -m 2 -X POST -H 'Content-Type: text/plain' --data "$BODY" \
    "http://127.0.0.1:$PORT/predict" 2>/dev/null | grep -q '"class"'
}

case "$CMD" in
  fg)
    install
    exec "$VENV/bin/python" "$HERE/ray_app.py" --host 127.0.0.1 --port "$PORT" "${APP_ARGS[@]}"
    ;;
  start)
    install
    if [ -f "$PIDFILE" ] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null; then
      echo "already running: PID $(cat "$PIDFILE")" >&2; exit 1
    fi
    (cd "$HERE" && exec "$VENV/bin/python" ray_app.py --host 127.0.0.1 --port "$PORT" "${APP_ARGS[@]}") \
      >"$LOG" 2>&1 </dev/null &
    pid=$!
    echo "$pid" >"$PIDFILE"
    for _ in $(seq "${TROUPE_RAY_START_TRIES:-600}"); do  # Ray's start: 5-120 s on 2 cores
      if answers; then echo "$pid"; exit 0; fi
      if ! kill -0 "$pid" 2>/dev/null; then
        echo "ray_app.py exited; last lines of $LOG:" >&2; tail -n 20 "$LOG" >&2; exit 1
      fi
      sleep 0.5
    done
    echo "no answer on 127.0.0.1:$PORT/predict in time; see $LOG" >&2
    "$0" stop "$PORT" || true
    exit 1
    ;;
  stop)
    [ -f "$PIDFILE" ] || { echo "no $PIDFILE" >&2; exit 0; }
    pid=$(cat "$PIDFILE")
    if kill -0 "$pid" 2>/dev/null; then
      kill -INT "$pid"
      for _ in $(seq 120); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
      if kill -0 "$pid" 2>/dev/null; then
        echo "PID $pid still up after 60 s: SIGKILL (its Ray processes share its fate)" >&2
        kill -KILL "$pid" 2>/dev/null || true
      fi
      # The PID is a child of the shell that ran `start` (now gone): nothing to wait for.
    fi
    rm -f "$PIDFILE"
    ;;
  ray-stop)
    "$VENV/bin/ray" stop
    ;;
  *)
    echo "usage: $0 start|stop|fg [PORT] | ray-stop" >&2; exit 2
    ;;
esac
