-- wrk script: one KServe v2 JSON inference request (a [1,16] FP32 input "x"), for PyTriton.
--   wrk -t1 -c16 -d10s --latency -s bench/peers_serve/post_v2.lua \
--       http://127.0.0.1:PORT/v2/models/classifier/infer
-- The 16 numbers are the ones post.lua sends. done() prints the same RESULT line (common.lua).
wrk.method = "POST"
wrk.body = '{"inputs":[{"name":"x","shape":[1,16],"datatype":"FP32","data":'
  .. '[0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,1.0,1.1,1.2,1.3,1.4,1.5,1.6]}]}'
wrk.headers["Content-Type"] = "application/json"
dofile(debug.getinfo(1, "S").source:sub(2):match("^(.-)[^/]*$") .. "common.lua")
