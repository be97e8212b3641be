-- post_v2bin64.lua - wrk script: POST the 64 rows of npy64.npy as tritonclient.http
-- sends them: the Open Inference Protocol's binary tensor data extension (a JSON
-- header, then the raw little-endian FP32 values; Inference-Header-Content-Length),
-- binary output asked for. bench/run.sh writes v2bin64.bin and v2bin64.hlen.
--   wrk -t2 -c8 -d10s --latency -s bench/post_v2bin64.lua http://127.0.0.1:PORT
dofile((debug.getinfo(1, "S").source:match("^@(.*/)") or "./") .. "report.lua")
bench_setup("/v2/models/fashion/infer", "v2bin64.bin", "application/octet-stream")
local dir = os.getenv("BENCH_BODY_DIR") or
   ((debug.getinfo(1, "S").source:match("^@(.*/)") or "./") .. "out")
local f = assert(io.open(dir .. "/v2bin64.hlen", "r"), "cannot open v2bin64.hlen (run bench/run.sh)")
wrk.headers["Inference-Header-Content-Length"] = f:read("*l")
f:close()
