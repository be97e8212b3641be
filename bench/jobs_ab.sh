#!/usr/bin/env bash
# bench/jobs_ab.sh OLD_BIN NEW_BIN [ROUNDS]: two modeld builds side by side on
# batch jobs long enough to measure on a noisy 2-core machine (a 10k-row job
# lasts ~60 ms): a 100k-row NPY job (the FashionMNIST test set 10 times,
# uint8) and the 60k-row IDX.gz training set, after one warm-up job, each
# build on a fresh server, alternating, ROUNDS (4) times. Prints the rows/s
# each job reports. Needs bench/out/t10k.npy (made by `make bench`).
# Build the old one with e.g. `git worktree add /tmp/old REV && make -C /tmp/old modeld`.
set -euo pipefail
cd "$(dirname "$0")/.."
OLD=$1 NEW=$2 ROUNDS=${3:-4}
OUT=$PWD/bench/out
PY=/usr/bin/python3
[ -f "$OUT/t10k.npy" ] || { echo "bench/jobs_ab.sh: run make bench first ($OUT/t10k.npy)" >&2; exit 1; }
TMP=$(mktemp -d "${TMPDIR:-/tmp}/jobs_ab.XXXXXX")
PID=""
trap '[ -n "$PID" ] && kill "$PID" 2>/dev/null; rm -rf "$TMP"' EXIT
"$PY" -c "import numpy as np, sys; a = np.load(sys.argv[1]); np.save(sys.argv[2], np.concatenate([a] * 10))" \
    "$OUT/t10k.npy" "$TMP/x100k.npy"
PORT=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
B=http://127.0.0.1:$PORT
D=/usr/share/datasets/fashion-mnist

. bench/job_lib.sh
job() { bench_job "$B" "$1" 0.1; } # input-json: print the job's rows_per_s

one() { # bin: a fresh server, a warm-up job, the two timed ones
    rm -rf "$TMP/store"
    OPENBLAS_NUM_THREADS=1 "$1" --host 127.0.0.1 --port "$PORT" --store "$TMP/store" --access-log off \
        --drain-seconds 0 --allowed-paths "$D,$OUT,$TMP" >"$TMP/modeld.log" 2>&1 &
    PID=$!
    for _ in $(seq 100); do curl -sf -o /dev/null "$B/healthz" && break; sleep 0.1; done
    curl -sf -o /dev/null "$B/models/fashion/versions" -F checkpoint=@examples/fashion_mnist/model.pt \
        -F "config=<examples/fashion_mnist/model.json"
    job "{\"path\":\"$OUT/t10k.npy\",\"format\":\"npy\"}" >/dev/null
    local npy idx
    npy=$(job "{\"path\":\"$TMP/x100k.npy\",\"format\":\"npy\"}")
    idx=$(job "{\"path\":\"$D/train-images-idx3-ubyte.gz\",\"format\":\"idx\",\"label\":\"$D/train-labels-idx1-ubyte.gz\"}")
    kill "$PID"; wait "$PID" 2>/dev/null || true; PID=""
    echo "$2 npy100k $npy idx60k $idx"
}

for _ in $(seq "$ROUNDS"); do
    one "$OLD" old
    one "$NEW" new
done
