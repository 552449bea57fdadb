#!/usr/bin/env bash
# DNS discovery for real (Discovery.* in troupe_tests): a network namespace of its own whose
# /etc/netns/NAME/hosts (with host.conf "multi on", so that a name may have several addresses)
# `ip netns exec` binds over /etc/hosts and /etc/host.conf; the test runs there, starts nodes on
# 127.0.0.2-6 and edits the name's addresses in that file. The machine's own /etc/hosts is never
# touched. Needs root and iproute2; exits 77 (skipped, with the reason) elsewhere.
set -euo pipefail
tests=$1
ns="trd$$"
dir=$(mktemp -d)
if ! ip netns add "$ns" 2>"$dir/err"; then
  echo "skipped: cannot create a network namespace here ($(head -c 200 "$dir/err"))"
  rm -rf "$dir"
  exit 77
fi
cleanup() {
  ip netns del "$ns" 2>/dev/null || true
  rm -rf "/etc/netns/$ns" "$dir"
}
trap cleanup EXIT
ip netns exec "$ns" ip link set lo up
mkdir -p "/etc/netns/$ns"
printf '127.0.0.1 localhost\n' > "/etc/netns/$ns/hosts"
printf 'multi on\n' > "/etc/netns/$ns/host.conf"
ip netns exec "$ns" env TROUPE_DISCOVERY_HOSTS=/etc/hosts "$tests" \
  --gtest_filter='Discovery.*' --gtest_also_run_disabled_tests 2>&1 | tee "$dir/out"
grep -q "\[  PASSED  \] 1 test" "$dir/out"
