#!/usr/bin/env bash
# bench/online_ab.sh OLD_BIN NEW_BIN [ROUNDS] [LOAD]: two modeld builds side
# by side on one online load, each build on a fresh server, alternating,
# ROUNDS (4) times: 2 s of warm-up, then BENCH_AB_SECONDS (5) of wrk. LOAD is
# json1 (1-row full-precision JSON, 32 connections; the default), json64
# (64 rows, 8 connections) or npy64. Prints req/s and p99 (wrk), rows a
# forward and mean queue wait (/metrics), and the server's CPU per request
# (its utime + stime ticks over the run from /proc): on a machine shared with
# other tenants CPU per request moves much less than req/s.
# Needs the bodies in bench/out/ (made by `make bench`). Build the old one
# with e.g. `git worktree add /tmp/old REV && make -C /tmp/old modeld`.
set -euo pipefail
cd "$(dirname "$0")/.."
OLD=$1 NEW=$2 ROUNDS=${3:-4} LOAD=${4:-json1} SECS=${BENCH_AB_SECONDS:-5}
OUT=$PWD/bench/out
case $LOAD in
json1) BODY=json1_full.json SCRIPT=post_json1.lua CONNS=32 ;;
json64) BODY=json64_full.json SCRIPT=post_json64.lua CONNS=8 ;;
npy64) BODY=npy64.npy SCRIPT=post_npy64.lua CONNS=8 ;;
*) echo "bench/online_ab.sh: LOAD is json1, json64 or npy64" >&2; exit 2 ;;
esac
[ -f "$OUT/$BODY" ] || { echo "bench/online_ab.sh: run make bench first ($OUT/$BODY)" >&2; exit 1; }
TMP=$(mktemp -d "${TMPDIR:-/tmp}/online_ab.XXXXXX")
PID=""
trap '[ -n "$PID" ] && kill "$PID" 2>/dev/null; rm -rf "$TMP"' EXIT
PORT=$(/usr/bin/python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
B=http://127.0.0.1:$PORT
TICK=$(getconf CLK_TCK)

sums() { # the model's _sum/_count samples from /metrics
    curl -sf "$B/metrics" | grep 'model="fashion"' | grep -E '_(sum|count)\{' || true
}

one() { # bin label
    rm -rf "$TMP/store"
    OPENBLAS_NUM_THREADS=1 "$1" --host 127.0.0.1 --port "$PORT" --store "$TMP/store" --access-log off \
        --drain-seconds 0 >"$TMP/modeld.log" 2>&1 &
    PID=$!
    for _ in $(seq 100); do curl -sf -o /dev/null "$B/healthz" && break; sleep 0.1; done
    curl -sf -o /dev/null "$B/models/fashion/versions" -F checkpoint=@examples/fashion_mnist/model.pt \
        -F "config=<$OUT/model_f.json"
    BENCH_BODY=$BODY BENCH_PATH=/models/fashion/predict \
        timeout 40 wrk -t2 -c"$CONNS" -d2s -s "bench/$SCRIPT" "$B" >/dev/null
    sums >"$TMP/m0"
    local c0 c1 r
    c0=$(awk '{print $14 + $15}' "/proc/$PID/stat")
    r=$(BENCH_BODY=$BODY BENCH_PATH=/models/fashion/predict \
        timeout $((SECS + 30)) wrk -t2 -c"$CONNS" -d"${SECS}s" --latency -s "bench/$SCRIPT" "$B" |
        awk '/Requests\/sec/ {q = $2} $1 == "99%" {p = $2} END {printf "req/s %s p99 %s", q, p}')
    c1=$(awk '{print $14 + $15}' "/proc/$PID/stat")
    sums >"$TMP/m1"
    kill "$PID"; wait "$PID" 2>/dev/null || true; PID=""
    paste "$TMP/m0" "$TMP/m1" | awk -v l="$2" -v r="$r" -v c=$((c1 - c0)) -v t="$TICK" '
        { split($1, a, "{"); d[a[1]] = $4 - $2 }
        END {
            n = d["modeld_queue_wait_seconds_count"]
            printf "%s %s rows/forward %.2f wait %.0fus cpu/request %.1fus\n", l, r,
                d["modeld_batch_rows_sum"] / d["modeld_batch_rows_count"],
                1e6 * d["modeld_queue_wait_seconds_sum"] / n, 1e6 * c / t / n
        }'
}

for _ in $(seq "$ROUNDS"); do
    one "$OLD" old
    one "$NEW" new
done
