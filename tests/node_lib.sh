# Shell helpers for the tests that run example binaries as nodes (sourced, not run).

# served_address FILE: waits (up to 10 s) for a node's "serving on HOST:PORT" line in FILE,
# then prints HOST:PORT.
served_address() {
  for _ in $(seq 100); do grep -q "serving on" "$1" 2>/dev/null && break; sleep 0.1; done
  sed -n 's/serving on //p' "$1"
}

# after_runner_started FILE: waits (up to 60 s) for the coordinator's "runner started" line (its
# -v output) in FILE, then half a second more: the job is under way on the nodes, however
# loaded the machine (a fixed sleep could land in the coordinator's handshake).
after_runner_started() {
  for _ in $(seq 600); do grep -q "runner started" "$1" 2>/dev/null && break; sleep 0.1; done
  sleep 0.5
}

# netns_two_nodes TAG NET NODE_ARGS...: a coordinator namespace ${TAG}c and two node namespaces
# ${TAG}n1, ${TAG}n2, linked by veth pairs (10.NET.i.1 on the coordinator's side, 10.NET.i.2 on
# node i's), each node running "$bin --serve 10.NET.i.2:0 NODE_ARGS..." (its output in
# $dir/node$i). Sets coord, dir and pids; everything is removed on exit. Exits 77 (skipped,
# with the reason) where namespaces are not allowed. Needs root and iproute2.
netns_two_nodes() {
  local net=$2
  tag=$1
  shift 2
  coord="${tag}c"
  dir=$(mktemp -d)
  pids=()
  if ! ip netns add "$coord" 2>"$dir/err"; then
    echo "skipped: cannot create a network namespace here ($(head -c 200 "$dir/err"))"
    rm -rf "$dir"
    exit 77
  fi
  trap netns_cleanup EXIT
  ip netns exec "$coord" ip link set lo up
  local i ns
  for i in 1 2; do
    ns="${tag}n$i"
    ip netns add "$ns"
    ip netns exec "$ns" ip link set lo up
    # veth pair: ${tag}c$i in the coordinator's namespace, ${tag}n$i in the node's
    ip link add "${tag}c$i" netns "$coord" type veth peer name "${tag}n$i" netns "$ns"
    ip netns exec "$coord" ip addr add "10.$net.$i.1/24" dev "${tag}c$i"
    ip netns exec "$coord" ip link set "${tag}c$i" up
    ip netns exec "$ns" ip addr add "10.$net.$i.2/24" dev "${tag}n$i"
    ip netns exec "$ns" ip link set "${tag}n$i" up
    ip netns exec "$ns" "$bin" --serve "10.$net.$i.2:0" "$@" > "$dir/node$i" &
    pids+=($!)
  done
}

netns_cleanup() {
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  for ns in "$coord" "${tag}n1" "${tag}n2"; do ip netns del "$ns" 2>/dev/null || true; done
  rm -rf "$dir"
}

# loopback_two_nodes [NODE_ARGS...]: two nodes of "$bin" on loopback (--serve 127.0.0.1:0
# --devices cpu,cpu NODE_ARGS...), their output in $dir/node1 and $dir/node2. Sets dir, pids, a
# and b (their HOST:PORT); they are SIGKILLed and $dir removed on exit.
loopback_two_nodes() {
  dir=$(mktemp -d)
  pids=()
  trap loopback_cleanup EXIT
  local i
  for i in 1 2; do
    "$bin" --serve 127.0.0.1:0 --devices cpu,cpu "$@" > "$dir/node$i" &
    pids+=($!)
  done
  a=$(served_address "$dir/node1")
  b=$(served_address "$dir/node2")
}

loopback_cleanup() {
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  rm -rf "$dir"
}
