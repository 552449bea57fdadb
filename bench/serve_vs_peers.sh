#!/usr/bin/env bash
# examples/serve (troupe) against Ray Serve and NVIDIA PyTriton, one after the other on this
# machine, with the same simulated model (2 ms a call + 0.1 ms a request, batches of up to 8
# waiting at most 2 ms) and the same load: wrk -t1 -cN -d10s --latency, N = 16 and 64.
#
#   bench/serve_vs_peers.sh                 # all; a peer whose venv is missing is skipped
#   TROUPE_SERVE=build/examples/serve DURATION=5s CONNS="16" bench/serve_vs_peers.sh
#   MODEL=/tmp/cnn.pt bench/serve_vs_peers.sh   # a real model (examples/export_model.py) instead
#
# With MODEL, every server runs that TorchScript file on the CPU (torch.jit.load in the peers,
# `serve --model` in troupe), requests are its first reference input (MODEL.ref.txt), batches of
# up to 8 waiting at most 2 ms, and each server gets the 2 cores as its users would set it up:
# troupe 2 CPU producers (one intra-op thread each, its default), Ray Serve 2 replicas of one
# CPU and one torch thread, PyTriton 2 model instances and 2 torch threads.
#
# Each server is started, warmed up (h2load: $WARMUP requests over 16 connections), measured,
# then stopped by its PID. Traffic goes to 127.0.0.1 only. Columns:
#   req/s, p50, p99   wrk's count and latency histogram (bench/peers_serve/post*.lua)
#   bad               non-2xx answers / socket errors
#   wrk cpu           the load generator's (user+sys)/wall, in cores
#   server cpu        the same for the server's whole process tree (Ray: driver, GCS, raylet,
#                     proxy, replica...; PyTriton: tritonserver, python proxy, model stub)
#   other cpu         the rest of the machine's busy time in the window (other jobs: compare
#                     rows only when it is near 0)
# Peers: bench/peers_serve/run_ray.sh installs Ray Serve into /opt/troupe-bench-ray; PyTriton
# needs a venv of Debian's own /usr/bin/python3.11 (its model stub links that libpython):
#   /usr/bin/python3.11 -m venv /opt/troupe-bench-pytriton
#   /opt/troupe-bench-pytriton/bin/pip install nvidia-pytriton==0.7.0
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PEERS=$ROOT/bench/peers_serve
DURATION=${DURATION:-10s}
CONNS=${CONNS:-16 64}
WARMUP=${WARMUP:-500}
RAY_VENV=${TROUPE_RAY_VENV:-/opt/troupe-bench-ray}
PYT_VENV=${TROUPE_PYTRITON_VENV:-/opt/troupe-bench-pytriton}
PORT_BASE=${PORT_BASE:-18180}
export RAY_USAGE_STATS_ENABLED=0 TROUPE_RAY_VENV=$RAY_VENV
if [ -z "${TROUPE_SERVE:-}" ]; then
  for s in build/examples/serve build-main/examples/serve; do
    [ -x "$s" ] && { TROUPE_SERVE=$s; break; }
  done
fi
for tool in wrk h2load curl /usr/bin/time python3; do
  command -v "$tool" >/dev/null || { echo "missing $tool (apt-get install -y wrk nghttp2-client curl time)" >&2; exit 1; }
done
[ -x "${TROUPE_SERVE:-}" ] || { echo "no examples/serve binary: build it, or set TROUPE_SERVE" >&2; exit 1; }

TMP=$(mktemp -d)
MODEL=${MODEL:-}
BODY=0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,1.0,1.1,1.2,1.3,1.4,1.5,1.6
if [ -n "$MODEL" ]; then
  [ -f "$MODEL.ref.txt" ] || { echo "no $MODEL.ref.txt: export it with examples/export_model.py" >&2; exit 1; }
  BODY=$(head -n 1 "$MODEL.ref.txt" | cut -d';' -f1 | xargs | tr ' ' ',')
fi
INPUTS=$(printf '%s' "$BODY" | awk -F, '{print NF}')
printf '%s' "$BODY" >"$TMP/body.txt"
printf '{"inputs":[{"name":"x","shape":[1,%s],"datatype":"FP32","data":[%s]}]}' "$INPUTS" "$BODY" >"$TMP/body_v2.json"
export TROUPE_RAY_BODY=$BODY
if [ -n "$MODEL" ]; then
  # The peers load the model with the project's torch (tools/setup.sh), after their own packages.
  torch_site=${TROUPE_VENV:-/opt/troupe-venv}/lib/python3.11/site-packages
  if [ -x "$PYT_VENV/bin/python" ]; then
    echo "$torch_site" >"$("$PYT_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/troupe_torch.pth"
  fi
  # Each peer's split of the 2 cores, overridable (RAY_REPLICAS=1 RAY_THREADS=2, say).
  export TROUPE_RAY_ARGS="--model $MODEL --inputs $INPUTS --replicas ${RAY_REPLICAS:-2} --num-cpus 2 --threads ${RAY_THREADS:-1}"
  PYT_ARGS=(--model "$MODEL" --inputs "$INPUTS" --instances "${PYT_INSTANCES:-2}" --threads "${PYT_THREADS:-2}")
  TROUPE_ARGS=(--model "$MODEL" --devices cpu,cpu)
else
  PYT_ARGS=()
  TROUPE_ARGS=(--devices cpu --call-us 2000 --item-us 100)
fi
ROWS=$TMP/rows
: >"$ROWS"
SPID=""        # the running server's PID
STOP_CMD=""    # how to stop it

cleanup() {
  [ -n "$SPID" ] && stop_server
  rm -rf "$TMP"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# Seconds of CPU (user+sys) used so far by PID and all its descendants.
tree_cpu() {
  python3 - "$1" <<'PY'
import os, sys
root, kids, cpu = int(sys.argv[1]), {}, {}
tick = os.sysconf("SC_CLK_TCK")
for p in os.listdir("/proc"):
    if not p.isdigit():
        continue
    try:
        s = open(f"/proc/{p}/stat").read()
    except OSError:
        continue
    f = s[s.rindex(")") + 2:].split()
    kids.setdefault(int(f[1]), []).append(int(p))
    cpu[int(p)] = (int(f[11]) + int(f[12])) / tick
todo, total = [root], 0.0
while todo:
    p = todo.pop()
    total += cpu.get(p, 0.0)
    todo += kids.get(p, [])
print(f"{total:.3f}")
PY
}

# Seconds the machine's CPUs were busy, all of them together.
busy_cpu() {
  awk -v t="$(getconf CLK_TCK)" '/^cpu /{print ($2+$3+$4+$7+$8+$9)/t; exit}' /proc/stat
}

alive() {  # PID: running, not a zombie
  local st; st=$(awk '{sub(/.*\) /, ""); print $1}' "/proc/$1/stat" 2>/dev/null) || return 1
  [ -n "$st" ] && [ "$st" != Z ]
}

# PID and all its descendants.
tree_pids() {
  local todo=("$1") p
  while [ ${#todo[@]} -gt 0 ]; do
    p=${todo[0]}; todo=("${todo[@]:1}")
    echo "$p"
    # shellcheck disable=SC2207
    todo+=($(ps -o pid= --ppid "$p"))
  done
}

# Stops the server, then waits for every process of its tree (tritonserver outlives PyTriton's
# Python side by up to its 30 s exit timeout); what is left after 45 s gets SIGKILL, by PID.
stop_server() {
  if [ -n "$SPID" ]; then
    local tree; tree=$(tree_pids "$SPID")
    eval "$STOP_CMD" >/dev/null 2>&1 || true
    for _ in $(seq 90); do
      local left=""
      for p in $tree; do alive "$p" && left="$left $p"; done
      [ -z "$left" ] && break
      sleep 0.5
    done
    for p in $tree; do alive "$p" && kill -KILL "$p" 2>/dev/null; done
    wait "$SPID" 2>/dev/null
  fi
  SPID=""
}

wait_answer() {  # URL BODYFILE CONTENT-TYPE PATTERN: until a 2xx answer matching PATTERN
  for _ in $(seq 240); do
    curl -sf -m 2 -X POST -H "Content-Type: $3" --data-binary "@$2" "$1" 2>/dev/null | grep -q "$4" && return 0
    kill -0 "$SPID" 2>/dev/null || return 1
    sleep 0.5
  done
  return 1
}

fail_row() {  # NAME WHY
  for c in $CONNS; do printf '%s\t%s\tFAILED: %s\n' "$1" "$c" "$2" >>"$ROWS"; done
  echo "  FAILED: $2" >&2
}

measure() {  # NAME URL LUA BODYFILE CONTENT-TYPE
  local name=$1 url=$2 lua=$3 body=$4 ctype=$5
  h2load --h1 -n "$WARMUP" -c 16 -d "$body" -H "content-type: $ctype" "$url" >"$TMP/warm.out" 2>&1
  echo "  warm-up: $(grep -m1 '^requests:' "$TMP/warm.out")" >&2
  for c in $CONNS; do
    local s0 b0 s1 b1 load
    load=$(cut -d' ' -f1 /proc/loadavg)
    s0=$(tree_cpu "$SPID"); b0=$(busy_cpu)
    TROUPE_WRK_BODY=$body /usr/bin/time -f '%U %S %e' -o "$TMP/time" \
      wrk -t1 -c"$c" -d"$DURATION" --latency -s "$lua" "$url" >"$TMP/wrk.out" 2>&1
    s1=$(tree_cpu "$SPID"); b1=$(busy_cpu)
    local result; result=$(grep '^RESULT' "$TMP/wrk.out")
    if [ -z "$result" ]; then
      fail_row "$name" "wrk: $(tail -n 1 "$TMP/wrk.out")"; continue
    fi
    read -r u s e <"$TMP/time"
    # shellcheck disable=SC2086
    eval ${result#RESULT }   # rps= p50_ms= p99_ms= requests= non2xx= errors=
    awk -v n="$name" -v c="$c" -v rps="$rps" -v p50="$p50_ms" -v p99="$p99_ms" \
        -v bad="$non2xx/$errors" -v u="$u" -v s="$s" -v e="$e" -v s0="$s0" -v s1="$s1" \
        -v b0="$b0" -v b1="$b1" -v load="$load" 'BEGIN {
      wrk = (u + s) / e; srv = (s1 - s0) / e; other = (b1 - b0) / e - wrk - srv
      if (other < 0) other = 0
      printf "%s\t%s\t%.0f\t%.2f\t%.2f\t%s\t%.2f\t%.2f\t%.2f\t%s\n", n, c, rps, p50, p99, bad, wrk, srv, other, load
    }' >>"$ROWS"
    echo "  -c$c: $result" >&2
  done
}

run_troupe() {  # NAME MAX_BATCH PORT
  local name=$1 port=$3
  echo "== $name" >&2
  "$TROUPE_SERVE" --listen "127.0.0.1:$port" --max-batch "$2" --max-delay-us 2000 \
    "${TROUPE_ARGS[@]}" >"$TMP/serve.err" 2>&1 &
  SPID=$!; STOP_CMD="kill -TERM $SPID"
  if wait_answer "http://127.0.0.1:$port/predict" "$TMP/body.txt" text/plain '"class"'; then
    measure "$name" "http://127.0.0.1:$port/predict" "$PEERS/post.lua" "$TMP/body.txt" text/plain
  else
    fail_row "$name" "$(tail -n 1 "$TMP/serve.err")"
  fi
  stop_server
}

run_ray() {
  local name="Ray Serve $("$RAY_VENV/bin/python" -c 'import ray; print(ray.__version__)' 2>/dev/null)" port=$1
  echo "== $name" >&2
  if ! SPID=$("$PEERS/run_ray.sh" start "$port"); then
    SPID=""; fail_row "$name" "run_ray.sh start failed"; return
  fi
  STOP_CMD="'$PEERS/run_ray.sh' stop $port"
  measure "$name" "http://127.0.0.1:$port/predict" "$PEERS/post.lua" "$TMP/body.txt" text/plain
  stop_server
}

run_pytriton() {
  local name="PyTriton $("$PYT_VENV/bin/python" -c 'from importlib.metadata import version; print(version("nvidia-pytriton"))' 2>/dev/null)" port=$1
  local url="http://127.0.0.1:$port/v2/models/classifier/infer"
  echo "== $name" >&2
  "$PYT_VENV/bin/python" "$PEERS/pytriton_app.py" --port "$port" "${PYT_ARGS[@]}" \
    >"$TMP/pytriton.log" 2>&1 &
  SPID=$!; STOP_CMD="kill -INT $SPID"
  if wait_answer "$url" "$TMP/body_v2.json" application/json '"outputs"'; then
    measure "$name (v2 JSON)" "$url" "$PEERS/post_v2.lua" "$TMP/body_v2.json" application/json
  else
    fail_row "$name" "$(grep -v '^[|+]' "$TMP/pytriton.log" | tail -n 1 | cut -c1-200)"
  fi
  stop_server
}

echo "serve_vs_peers: $(date -u +%FT%TZ), $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg), $(wrk -v 2>&1 | head -n1 | cut -d' ' -f1-2), serve=$TROUPE_SERVE" >&2
if [ -z "${PEERS_ONLY:-}" ]; then
  run_troupe "troupe serve, batch 8" 8 "$PORT_BASE"
  run_troupe "troupe serve, no batching" 0 "$((PORT_BASE + 1))"
fi
if [ -x "$RAY_VENV/bin/python" ]; then run_ray "$((PORT_BASE + 2))"
else echo "== Ray Serve: skipped (no $RAY_VENV; bench/peers_serve/run_ray.sh start installs it)" >&2; fi
if "$PYT_VENV/bin/python" -c 'import pytriton' 2>/dev/null; then run_pytriton "$((PORT_BASE + 10))"
else echo "== PyTriton: skipped (no $PYT_VENV with nvidia-pytriton)" >&2; fi

echo
if [ -n "$MODEL" ]; then
  echo "wrk -t1 -cN -d$DURATION --latency; model $MODEL ($INPUTS inputs), batch <= 8, wait <= 2 ms; cpu in cores"
else
  echo "wrk -t1 -cN -d$DURATION --latency; model 2 ms/call + 0.1 ms/request, batch <= 8, wait <= 2 ms; cpu in cores"
fi
printf '%-34s %5s %8s %8s %8s %7s %7s %7s %7s %6s\n' server conns 'req/s' 'p50 ms' 'p99 ms' bad 'wrk' 'server' 'other' load1
while IFS=$'\t' read -r n c rps p50 p99 bad w s o l; do
  case "$rps" in
    FAILED*) printf '%-34s %5s %s\n' "$n" "$c" "$rps" ;;
    *) printf '%-34s %5s %8s %8s %8s %7s %7s %7s %7s %6s\n' "$n" "$c" "$rps" "$p50" "$p99" "$bad" "$w" "$s" "$o" "$l" ;;
  esac
done <"$ROWS"
