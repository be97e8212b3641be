#!/usr/bin/env bash
# bench/multi_io.sh - issue 27 in `make bench`: the single-input figures of
# the build before named inputs and outputs and of this one side by side
# (bench/online_ab.sh: 1-row and 64-row full-precision JSON, alternating
# fresh servers), then the two-input model of examples/two_inputs under the
# same wrk load in each request form (64 rows as objects, as columns, V2
# JSON), rows/s and p99 beside the single-input 64-row figure.
# OLD_REV (default 8d403f5, the commit before issue 27) is built once into
# build/bench-old (a git worktree). Needs the bodies `make bench` writes.
# Knobs: BENCH_AB_ROUNDS (3), BENCH_AB_SECONDS (5), BENCH_DURATION (5).
set -euo pipefail
cd "$(dirname "$0")/.."
OLD_REV=${OLD_REV:-8d403f5}
ROUNDS=${BENCH_AB_ROUNDS:-3}
SECS=${BENCH_DURATION:-5}
OUT=$PWD/bench/out
OLD=$PWD/build/bench-old/modeld
if [ ! -x "$OLD" ]; then
    [ -d build/bench-old ] || git worktree add -f build/bench-old "$OLD_REV" >/dev/null
    make -C build/bench-old -j"$(nproc)" modeld >/dev/null
fi
[ -f "$OUT/json1_full.json" ] || { echo "bench/multi_io.sh: run make bench first" >&2; exit 1; }
echo "== single-input figures, the build before issue 27 (old) and this one (new), same loads"
for load in json1 json64; do
    echo "-- $load"
    BENCH_AB_SECONDS=${BENCH_AB_SECONDS:-5} bash bench/online_ab.sh "$OLD" "$PWD/modeld" "$ROUNDS" "$load"
done

echo "== the two-input model (examples/two_inputs), 64 rows a request, 8 connections"
TMP=$(mktemp -d "${TMPDIR:-/tmp}/multi_io.XXXXXX")
PID=""
trap '[ -n "$PID" ] && kill "$PID" 2>/dev/null; rm -rf "$TMP"' EXIT
/usr/bin/python3 - "$OUT" <<'PY'
import json, sys, random
out = sys.argv[1]
random.seed(5)
rows = [{"numeric": [random.uniform(-2, 2) for _ in range(4)], "city_id": random.randrange(10)}
        for _ in range(64)]
json.dump(rows, open(f"{out}/mio64_rows.json", "w"))
json.dump({"inputs": {"numeric": [r["numeric"] for r in rows],
                      "city_id": [r["city_id"] for r in rows]}}, open(f"{out}/mio64_cols.json", "w"))
json.dump({"inputs": [
    {"name": "numeric", "shape": [64, 4], "datatype": "FP32",
     "data": [v for r in rows for v in r["numeric"]]},
    {"name": "city_id", "shape": [64], "datatype": "INT64", "data": [r["city_id"] for r in rows]}]},
    open(f"{out}/mio64_v2.json", "w"))
PY
PORT=$(/usr/bin/python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
B=http://127.0.0.1:$PORT
OPENBLAS_NUM_THREADS=1 ./modeld --host 127.0.0.1 --port "$PORT" --store "$TMP/store" --access-log off \
    --drain-seconds 0 >"$TMP/modeld.log" 2>&1 &
PID=$!
for _ in $(seq 100); do curl -sf -o /dev/null "$B/healthz" && break; sleep 0.1; done
curl -sf -o /dev/null "$B/models/tabular/versions" -F checkpoint=@examples/two_inputs/model.pt \
    -F 'config=<examples/two_inputs/model.json'
run() { # label body path
    BENCH_BODY=$2 BENCH_PATH=$3 timeout 40 wrk -t2 -c8 -d2s -s bench/post_json64.lua "$B" >/dev/null
    BENCH_BODY=$2 BENCH_PATH=$3 timeout $((SECS + 30)) wrk -t2 -c8 -d"${SECS}s" --latency \
        -s bench/post_json64.lua "$B" >"$TMP/wrk.txt"
    if grep -q "Non-2xx" "$TMP/wrk.txt"; then
        echo "bench/multi_io.sh: $1 answered errors:" >&2
        curl -s "$B$3" --data-binary "@$OUT/$2" | head -c 400 >&2
        exit 1
    fi
    awk -v l="$1" '/Requests\/sec/ {q = $2} $1 == "99%" {p = $2}
        END {printf "%-22s req/s %8.1f rows/s %9.0f p99 %s\n", l, q, 64 * q, p}' "$TMP/wrk.txt"
}
run "rows as objects" mio64_rows.json /models/tabular/predict
run "columns" mio64_cols.json /models/tabular/predict
run "V2 JSON (INT64 ids)" mio64_v2.json /v2/models/tabular/infer
kill "$PID"; wait "$PID" 2>/dev/null || true; PID=""
