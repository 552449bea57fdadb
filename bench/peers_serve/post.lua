-- wrk script: POST /predict with a 16-number text body (troupe serve, Ray Serve).
--   wrk -t1 -c16 -d10s --latency -s bench/peers_serve/post.lua http://127.0.0.1:PORT/predict
-- done() prints one machine-readable line:
--   RESULT rps=<requests/s> p50_ms=<..> p99_ms=<..> requests=<n> non2xx=<n> errors=<n>
wrk.method = "POST"
wrk.body = "0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,1.0,1.1,1.2,1.3,1.4,1.5,1.6"
-- TROUPE_WRK_BODY: a file whose content is the body instead (bench/serve_vs_peers.sh MODEL=...).
local from = os.getenv("TROUPE_WRK_BODY")
if from and from ~= "" then
  local f = assert(io.open(from, "rb"))
  wrk.body = f:read("*a")
  f:close()
end
wrk.headers["Content-Type"] = "text/plain"

-- Non-2xx answers and socket errors come from wrk's summary, so a failing server shows.
function done(summary, latency, requests)
  local secs = summary.duration / 1e6
  local e = summary.errors
  local errs = e.connect + e.read + e.write + e.timeout
  io.write(string.format(
    "RESULT rps=%.1f p50_ms=%.3f p99_ms=%.3f requests=%d non2xx=%d errors=%d\n",
    summary.requests / secs, latency:percentile(50) / 1000, latency:percentile(99) / 1000,
    summary.requests, e.status, errs))
end
