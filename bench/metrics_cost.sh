#!/usr/bin/env bash
# What serving metrics costs a job (issue 25): the sum_of_squares example with --metrics and a
# scraper reading /metrics every second (as Prometheus would, at a 1 s interval: 5 times
# Prometheus' usual rate), against the same job without, timed in turn by farm-bench (--vs:
# ratios pair by pair). Two jobs: trivial items and ~10 us items. The statistics the metrics read
# (histogram observations per chunk) are kept whether or not they are served: this measures
# serving and scraping only.
#
#   bench/metrics_cost.sh [BIN] [RUNS]        (defaults: build/examples/sum_of_squares 6)
set -euo pipefail
bin=${1:-build/examples/sum_of_squares}
runs=${2:-6}
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
scraped() {  # the job with --metrics, a scrape every second while it runs: one curl process
  # (--rate) for all of them, as a Prometheus server is one process (a curl started every second
  # was most of the scraper's cost on these 2 cores)
  printf "%s" "$bin $* --metrics 127.0.0.1:$port & p=\$!; curl -s --rate 1/s 'http://127.0.0.1:$port/metrics?[1-100000]' > /dev/null & s=\$!; wait \$p; r=\$?; kill \$s; exit \$r"
}
for job in "--items 2000000000 --work-ms 0" "--items 500000 --work-ms 0.01"; do
  args="--devices cpu,cpu --progress off $job"
  echo "== $job: A with metrics served and scraped every second, B without"
  farm-bench -n "$runs" --timeout 600 --vs "sh -c '$bin $args'" -- sh -c "$(scraped $args)"
done
