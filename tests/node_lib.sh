# Shell helpers for the tests that run example binaries as nodes (sourced, not run).

# served_address FILE: waits (up to 10 s) for a node's "serving on HOST:PORT" line in FILE,
# then prints HOST:PORT.
served_address() {
  for _ in $(seq 100); do grep -q "serving on" "$1" 2>/dev/null && break; sleep 0.1; done
  sed -n 's/serving on //p' "$1"
}
