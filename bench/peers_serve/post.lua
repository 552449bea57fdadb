-- wrk script: POST /predict with a 16-number text body (troupe serve, Ray Serve).
--   wrk -t1 -c16 -d10s --latency -s bench/peers_serve/post.lua http://127.0.0.1:PORT/predict
-- done() prints one machine-readable line (common.lua).
wrk.method = "POST"
wrk.body = "0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,1.0,1.1,1.2,1.3,1.4,1.5,1.6"
wrk.headers["Content-Type"] = "text/plain"
dofile(debug.getinfo(1, "S").source:sub(2):match("^(.-)[^/]*$") .. "common.lua")
