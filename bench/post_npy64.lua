-- post_npy64.lua - wrk script: POST a 64-row NPY float32 body (npy64.npy, made by
-- bench/run.sh) to $BENCH_PATH (default /models/fashion/predict).
--   wrk -t2 -c8 -d10s --latency -s bench/post_npy64.lua http://127.0.0.1:PORT
dofile((debug.getinfo(1, "S").source:match("^@(.*/)") or "./") .. "report.lua")
-- NPY in and NPY out: the binary path end to end
bench_setup("/models/fashion/predict", "npy64.npy", "application/x-npy", "application/x-npy")
