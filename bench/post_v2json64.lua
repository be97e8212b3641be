-- post_v2json64.lua - wrk script: POST the 64 rows of json64_full.json as a V2
-- client without the binary extension sends them: {"inputs": [{"shape": [64, 784],
-- "datatype": "FP32", "data": [...]}]}, the data flat (the protocol's form) in
-- full precision, to /v2/models/fashionf/infer; JSON answer. bench/run.sh writes
-- v2json64_full.json.
--   wrk -t2 -c8 -d10s --latency -s bench/post_v2json64.lua http://127.0.0.1:PORT
dofile((debug.getinfo(1, "S").source:match("^@(.*/)") or "./") .. "report.lua")
bench_setup("/v2/models/fashionf/infer", "v2json64_full.json", "application/json")
