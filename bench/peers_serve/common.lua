-- What post.lua and post_v2.lua share (they load it with dofile, after setting their body):
-- TROUPE_WRK_BODY, a file whose content is the body instead (bench/serve_vs_peers.sh MODEL=...),
-- and done(), which prints one machine-readable line:
--   RESULT rps=<requests/s> p50_ms=<..> p99_ms=<..> requests=<n> non2xx=<n> errors=<n>
local from = os.getenv("TROUPE_WRK_BODY")
if from and from ~= "" then
  local f = assert(io.open(from, "rb"))
  wrk.body = f:read("*a")
  f:close()
end

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
