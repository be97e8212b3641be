#!/usr/bin/env bash
# gpu_wrk.sh - HTTP against in-process on cuda at batch 64, on a machine with a
# GPU: the FashionMNIST MLP and a CIFAR-size CNN (3x32x32 in, three convs, two
# linears), 64-row full-precision float32 NPY bodies sent by wrk (not Python
# clients, which bound the rate before the server does).
#
#   bench/gpu_wrk.sh            # after bench/gpu_check.sh built ./modeld and
#                               # build/bench/inprocess with WITH_CUDA=1
#
# The in-process side is build/bench/inprocess on the same model file, device
# cuda, batch 64, at 4 and at nproc threads; its best is the ceiling. The
# server runs with its defaults. Environment: WRK_SECONDS (default 5),
# WRK_CONNS (default 32), WRK (the wrk binary, default wrk on PATH), DEPS_LIB
# (a folder of carried libraries for modeld, inprocess and wrk alone: the
# system's curl and python3 keep their own).
# Prints one table; the goal is HTTP >= 50 % of in-process at batch 64.
set -u
cd "$(dirname "$0")/.."
SECS=${WRK_SECONDS:-5}
CONNS=${WRK_CONNS:-32}
WRK=${WRK:-wrk}
DEVICE=${DEVICE:-cuda} # cpu: try the script on a machine without a GPU
PY=${PYTHON:-python3} # the one with torch and numpy
deps() { LD_LIBRARY_PATH=${DEPS_LIB:+$DEPS_LIB:}${LD_LIBRARY_PATH:-} "$@"; }
T=$(mktemp -d)
trap 'kill $PID 2>/dev/null; wait 2>/dev/null; rm -rf "$T"' EXIT

cat >"$T/make.py" <<'EOF'
import sys
import numpy as np
import torch
t = sys.argv[1]
torch.manual_seed(0)
nn = torch.nn


class Cifar(nn.Module):
    def __init__(self):
        super().__init__()
        self.f = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2), nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(128 * 8 * 8, 256), nn.ReLU(), nn.Linear(256, 10))

    def forward(self, x):
        return self.f(x.view(-1, 3, 32, 32))


torch.jit.script(Cifar().eval()).save(f"{t}/cifar.pt")
rng = np.random.default_rng(0)
np.save(f"{t}/mlp64.npy", rng.random((64, 784), dtype=np.float32))
np.save(f"{t}/cifar64.npy", rng.random((64, 3072), dtype=np.float32))
EOF
# torch.jit.script reads the class's source: from a file, not stdin
$PY "$T/make.py" "$T" || { echo "FAIL making the models"; exit 1; }
cp examples/fashion_mnist/model.pt "$T/mlp.pt"

port=$($PY -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])')
base=http://127.0.0.1:$port
deps ./modeld --host 127.0.0.1 --port "$port" --store "$T/store" --access-log off \
    --drain-seconds 0 2>"$T/modeld.log" &
PID=$!
for _ in $(seq 600); do kill -0 $PID 2>/dev/null || break; curl -fs "$base/healthz" >/dev/null && break; sleep 0.1; done
for m in mlp:784 cifar:3072; do
  name=${m%%:*} f=${m##*:}
  curl -fsS -o /dev/null -F "checkpoint=@$T/$name.pt" \
      -F "config={\"input\":{\"shape\":[$f]},\"device\":\"$DEVICE\"}" "$base/models/$name/versions" \
      || { echo "FAIL deploy $name"; tail -5 "$T/modeld.log"; exit 1; }
  curl -fsS -o /dev/null -H 'Content-Type: application/x-npy' --data-binary "@$T/${name}64.npy" \
      "$base/models/$name/predict" || { echo "FAIL predict $name"; exit 1; }
done

rows_inproc() { # model features threads -> rows/s
  deps build/bench/inprocess --model "$T/$1.pt" --device "$DEVICE" --batch 64 --features "$2" \
      --threads "$3" --seconds "$SECS" | $PY -c 'import json,sys;print(json.loads(sys.stdin.readline())["rows_per_s"])'
}
rows_http() { # model -> "rows/s p50 p99 errors"
  BENCH_BODY_DIR=$T BENCH_BODY=${1}64.npy BENCH_PATH=/models/$1/predict \
      deps "$WRK" -t4 -c"$CONNS" -d"${SECS}s" --latency -s bench/post_npy64.lua "$base" |
      $PY -c '
import json, sys
for line in sys.stdin:
    if line.startswith("BENCH_JSON "):
        j = json.loads(line[11:])
        e = sum(j["errors"].values())
        l = j["latency_ms"]
        print(64 * j["req_per_s"], l["p50"], l["p99"], e)'
}

printf '%-6s %14s %12s %9s %8s %8s %6s %7s\n' model inproc_rows/s http_rows/s http_req/s p50_ms \
    p99_ms errors ratio
for m in mlp:784 cifar:3072; do
  name=${m%%:*} f=${m##*:}
  a=$(rows_inproc "$name" "$f" 4) b=$(rows_inproc "$name" "$f" "$(nproc)")
  best=$($PY -c "print(max($a, $b))")
  read -r h p50 p99 errs < <(rows_http "$name")
  $PY -c "
best, h = $best, $h
print(f'{\"$name\":6} {best:14.0f} {h:12.0f} {h / 64:9.0f} {$p50:8.2f} {$p99:8.2f} {$errs:6d} {h / best:7.0%}')"
done
echo "server: $(nproc) cores, default workers; wrk -t4 -c$CONNS -d${SECS}s, 64-row float32 NPY in and out"
