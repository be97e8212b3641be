-- post_png1.lua - wrk script: POST one FashionMNIST test image as a PNG body
-- (png1.png, made by bench/run.sh) with Content-Type image/png to $BENCH_PATH
-- (default /models/fashionimg/predict, the model deployed with preprocess.image).
--   wrk -t2 -c32 -d10s --latency -s bench/post_png1.lua http://127.0.0.1:PORT
dofile((debug.getinfo(1, "S").source:match("^@(.*/)") or "./") .. "report.lua")
bench_setup("/models/fashionimg/predict", "png1.png", "image/png")
