-- post_json1.lua - wrk script: POST a 1-row JSON body (json1_int.json or $BENCH_BODY, made by
-- bench/run.sh) to $BENCH_PATH (default /models/fashion/predict).
--   wrk -t2 -c8 -d10s --latency -s bench/post_json1.lua http://127.0.0.1:PORT
dofile((debug.getinfo(1, "S").source:match("^@(.*/)") or "./") .. "report.lua")
bench_setup("/models/fashion/predict", "json1_int.json", "application/json")
