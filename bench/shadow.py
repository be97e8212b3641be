#!/usr/bin/python3
"""
shadow.py - what a shadow version costs the primary (`make bench`, issue 28).

One modeld, the FashionMNIST model deployed twice (version 1 the default,
version 2 the same bytes). The same wrk load of 1-row full-precision JSON
requests (what clients send: json.dumps of a float32 row scaled to [0, 1])
runs with no shadow and with version 2 as a 100 % shadow, alternated for
BENCH_SHADOW_ROUNDS rounds (the machine is noisy; the median is shown), at a
light load (BENCH_SHADOW_LIGHT connections: the server is not saturated, so
the shadow has idle cores to run on) and at the load of bench/run.sh
(BENCH_C1 connections: saturated, where every shadow forward takes CPU the
primary would have used). The primary's answers must all be 200; the
shadow's comparisons are printed beside (agreement must be 1.0).

    /usr/bin/python3 bench/shadow.py [--modeld ./modeld]

Knobs (environment): BENCH_DURATION (wrk seconds per run, 10), BENCH_C1 (32),
BENCH_SHADOW_LIGHT (2), BENCH_WRK_THREADS (2), BENCH_SHADOW_ROUNDS (2).
Prints a table and writes bench/out/shadow.json. Exits non-zero when
something breaks, not when a target is missed.
"""
import argparse
import gzip
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np
import requests

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
import cluster  # noqa: E402  (its Modeld and wrk helpers)

OUT = cluster.OUT
BODIES = cluster.BODIES
LIGHT = int(os.environ.get("BENCH_SHADOW_LIGHT", "2"))
ROUNDS = int(os.environ.get("BENCH_SHADOW_ROUNDS", "2"))


def make_body():
    BODIES.mkdir(parents=True, exist_ok=True)
    with gzip.open("/usr/share/datasets/fashion-mnist/t10k-images-idx3-ubyte.gz") as f:
        images = np.frombuffer(f.read()[16:], dtype=np.uint8).reshape(-1, 784)
    row = (images[:1].astype(np.float32) / 255.0).tolist()
    with open(BODIES / "json1_full.json", "w") as f:
        json.dump({"instances": row}, f)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--modeld", default=str(REPO / "modeld"))
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    make_body()
    config = {**cluster.CONFIG}
    config.pop("preprocess", None)  # the body holds ToTensor's values already
    cluster.CONFIG = config
    tmp = Path(tempfile.mkdtemp(prefix="modeld-shadow-"))
    srv = cluster.Modeld(args.modeld, tmp / "store", name="shadow")
    results = {}
    try:
        srv.deploy()
        srv.deploy(make_default="false")
        env_body = os.environ.get("BENCH_BODY")
        os.environ["BENCH_BODY"] = "json1_full.json"
        for conns, load in ((LIGHT, "light"), (cluster.C1, "saturated")):
            for rnd in range(ROUNDS):
                for mode in ("no shadow", "100 % shadow"):
                    shadow = {"version": 2, "percent": 100} if mode != "no shadow" else None
                    r = requests.patch(f"{srv.url}/models/fashion", json={"shadow": shadow},
                                       timeout=60)
                    if r.status_code != 200:
                        sys.exit(f"PATCH shadow answered {r.status_code}: {r.text}")
                    w = cluster.wrk(f"shadow-{load}-{rnd}-{mode.replace(' ', '')}",
                                    "post_json1.lua", srv, conns)
                    if w["non2xx"] or sum(w["errors"].values()):
                        sys.exit(f"errors under {mode} at {load} load: {w}")
                    results.setdefault((load, conns, mode), []).append(w)
        if env_body is None:
            del os.environ["BENCH_BODY"]
        pair = requests.get(f"{srv.url}/models/fashion/shadow", timeout=30).json()["pairs"]
    finally:
        srv.stop()
    print("\nA 100 % shadow and the primary's answers (1-row full-precision JSON, "
          f"median of {ROUNDS} alternated rounds, {cluster.DURATION} s each):")
    print(f"{'load':>22} {'mode':>14} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'cores':>6}")
    table = []
    for (load, conns, mode), runs in results.items():
        med = {k: statistics.median(r[k] for r in runs) for k in ("req_per_s", "server_cpu_cores")}
        p50 = statistics.median(r["latency_ms"]["p50"] for r in runs)
        p99 = statistics.median(r["latency_ms"]["p99"] for r in runs)
        print(f"{load + f' ({conns} conns)':>22} {mode:>14} {med['req_per_s']:8.0f} {p50:8.2f} "
              f"{p99:8.2f} {med['server_cpu_cores']:6.2f}")
        table.append({"load": load, "connections": conns, "mode": mode, **med, "p50_ms": p50,
                      "p99_ms": p99})
    for p in pair:
        print(f"shadow {p['primary']} -> {p['shadow']}: compared {p['compared']}, "
              f"agreement {p['agreement']}, max abs diff {p['max_abs_diff']}, errors "
              f"{p['errors']}, dropped {p['dropped']} (copies past 64 waiting)")
        if p["agreement"] not in (None, 1.0):
            sys.exit("a copy of the same model must agree 1.0")
    (OUT / "shadow.json").write_text(json.dumps({"table": table, "pairs": pair}, indent=1))


if __name__ == "__main__":
    main()
