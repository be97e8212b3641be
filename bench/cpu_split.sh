#!/usr/bin/env bash
# bench/cpu_split.sh - where a load's CPU goes, per request, by thread: for the
# ratio targets of bench/RESULTS.md, what each scenario costs beside the forward.
#
#   bench/cpu_split.sh http LUA [BODY] [SECONDS]   wrk -t2 -c8 on a fresh server
#   bench/cpu_split.sh job idx|npy [ROUNDS]        60k-row jobs (IDX.gz training set,
#                                                  or t10k.npy 6 times), batch 64
#
# Prints the CPU seconds of each thread group of modeld over the load (from
# /proc/PID/task/*/stat: md-<model> online workers, mj-<model> job workers,
# MHD-worker HTTP threads, md:decode the decode pool, md-job<N> job runners),
# per request (or per row), the model's forward count and wall time from
# /metrics, and then the in-process forward's CPU per batch-64 forward
# (build/bench/inprocess, 2 threads, 3 s) for comparison. Bodies and models
# as `make bench` makes them (run it once first: bench/out/). Loopback only.
set -euo pipefail
cd "$(dirname "$0")/.."
MODE=${1:?usage: bench/cpu_split.sh http LUA [BODY] [SECONDS] | job idx|npy [ROUNDS]}
OUT=$PWD/bench/out
PY=/usr/bin/python3
D=/usr/share/datasets/fashion-mnist
[ -f "$OUT/t10k.npy" ] || { echo "bench/cpu_split.sh: run make bench first ($OUT)" >&2; exit 1; }
TMP=$(mktemp -d "${TMPDIR:-/tmp}/cpu_split.XXXXXX")
PID=""
trap '[ -n "$PID" ] && kill "$PID" 2>/dev/null; rm -rf "$TMP"' EXIT
PORT=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
B=http://127.0.0.1:$PORT
OPENBLAS_NUM_THREADS=1 ./modeld --host 127.0.0.1 --port "$PORT" --store "$TMP/store" --access-log off \
    --drain-seconds 0 --allowed-paths "$D,$OUT,$TMP" >"$TMP/modeld.log" 2>&1 &
PID=$!
for _ in $(seq 100); do curl -sf -o /dev/null "$B/healthz" && break; sleep 0.1; done
for spec in fashion:examples/fashion_mnist/model.json fashionf:$OUT/model_f.json; do
    curl -sf -o /dev/null "$B/models/${spec%%:*}/versions" -F checkpoint=@examples/fashion_mnist/model.pt \
        -F "config=<${spec#*:}"
done
CLK=$(getconf CLK_TCK)
threads() { # "group seconds" per thread group of modeld
    for t in /proc/$PID/task/*; do
        awk -v t="$CLK" '{ c = $0; sub(/^.*\) /, "", c); n = $0; sub(/^[^(]*\(/, "", n); sub(/\).*$/, "", n)
            split(c, a, " "); printf "%s %.3f\n", n, (a[12] + a[13]) / t }' "$t/stat"
    done | awk '{ s[$1] += $2 } END { for (k in s) print k, s[k] }' | sort
}
forwards() { # "seconds count" of every model's forwards
    curl -s "$B/metrics" | awk '/^modeld_forward_seconds_sum/ { s += $2 } /^modeld_forward_seconds_count/ { c += $2 }
        END { printf "%.6f %d\n", s, c }'
}
split_report() { # before after units what
    join <(echo "$1") <(echo "$2") | awk -v n="$3" -v what="$4" '{ d = $3 - $2; if (d > 0)
        printf "  %-14s %7.2f s   %8.1f us per %s\n", $1, d, d / n * 1e6, what }'
}
if [ "$MODE" = http ]; then
    LUA=$2 BODY=${3:-} SECS=${4:-8}
    [ -n "$BODY" ] && export BENCH_BODY=$BODY
    wrk -t1 -c2 -d2s -s "$LUA" "$B" >/dev/null 2>&1
    t0=$(threads) f0=$(forwards)
    wrk -t2 -c8 -d"${SECS}s" --latency -s "$LUA" "$B" >"$TMP/wrk.txt"
    t1=$(threads) f1=$(forwards)
    n=$(sed -n 's/^BENCH_JSON .*"requests":\([0-9]*\).*/\1/p' "$TMP/wrk.txt")
    echo "$LUA ${BODY:+($BODY) }: $n requests in $SECS s ($(grep Requests/sec "$TMP/wrk.txt" | awk '{print $2}') req/s, p99 $(awk '$1 == "99%" {print $2}' "$TMP/wrk.txt"))"
    split_report "$t0" "$t1" "$n" request
    read -r fs0 fc0 <<<"$f0"; read -r fs1 fc1 <<<"$f1"
    awk -v s="$(echo "$fs1 - $fs0" | bc -l)" -v c="$(echo "$fc1 - $fc0" | bc)" 'BEGIN {
        printf "  forwards: %d, %.1f us of wall time each\n", c, s / c * 1e6 }'
else
    KIND=${2:-idx} ROUNDS=${3:-3}
    if [ "$KIND" = idx ]; then
        IN="{\"path\":\"$D/train-images-idx3-ubyte.gz\",\"format\":\"idx\",\"label\":\"$D/train-labels-idx1-ubyte.gz\"}"
    else
        "$PY" -c "import numpy as np, sys; a = np.load(sys.argv[1]); np.save(sys.argv[2], np.concatenate([a] * 6))" \
            "$OUT/t10k.npy" "$TMP/x60k.npy"
        IN="{\"path\":\"$TMP/x60k.npy\",\"format\":\"npy\"}"
    fi
    . bench/job_lib.sh
    job() { bench_job "$B" "$IN" 0.5; }
    job >/dev/null
    t0=$(threads) f0=$(forwards)
    rates=""
    for _ in $(seq "$ROUNDS"); do rates="$rates $(job)"; done
    t1=$(threads) f1=$(forwards)
    echo "$ROUNDS jobs of 60000 rows ($KIND), rows/s each:$rates"
    split_report "$t0" "$t1" $((ROUNDS * 60000)) row
    read -r fs0 fc0 <<<"$f0"; read -r fs1 fc1 <<<"$f1"
    awk -v s="$(echo "$fs1 - $fs0" | bc -l)" -v c="$(echo "$fc1 - $fc0" | bc)" 'BEGIN {
        printf "  forwards: %d, %.1f us of wall time each\n", c, s / c * 1e6 }'
fi
kill "$PID"; wait "$PID" 2>/dev/null || true; PID=""
OPENBLAS_NUM_THREADS=1 build/bench/inprocess --batch 64 --seconds 3 --threads 2 |
    "$PY" -c 'import json, sys; r = json.loads(sys.stdin.readline())
print("  in-process (2 threads, 3 s): %.0f rows/s, %.1f us of CPU a batch-64 forward"
      % (r["rows_per_s"], 2 * r["seconds"] / r["forwards"] * 1e6))'
