#!/usr/bin/python3
"""
cluster.py - modeld on several hosts, measured (`make bench`, issue 25).

Against a throwaway PostgreSQL 15 cluster (tests/e2e/pg.py: initdb as
nobody, a private socket and port, stopped at the end), on loopback:

1. online, side by side in one run: the FashionMNIST model on modeld with
   its SQLite index (single-host mode) and on modeld with index_url =
   PostgreSQL (cluster mode), the same wrk loads as bench/run.sh (1-row JSON
   at BENCH_C1 connections, 64-row NPY at BENCH_C64), the two modes
   alternated for BENCH_CLUSTER_ROUNDS rounds (the machine is noisy; the
   median is shown). Then the cluster-mode server once more with PostgreSQL
   stopped: the predict path touches neither the index nor S3, so the
   figure must not move. The transactions PostgreSQL counted during each
   cluster-mode run are printed beside it (the generation poll's, not one
   per request).
2. convergence: replicas A and B on one database (blobs in one local
   directory: the blob seam is other work), B answering predictions in a
   tight loop. A deploy (a new default) or a default change through A, then
   the time until B answers with the new version: from A's answer (the
   change committed and acknowledged) and from the request's start. By
   NOTIFY (store_poll_ms 60000: the poll cannot be what brings it), and,
   for comparison, by the generation poll alone (store_poll_ms 1000) on a
   shared SQLite store, as replicas on one host converge.

    /usr/bin/python3 bench/cluster.py [--modeld ./modeld]

Knobs (environment): BENCH_DURATION (wrk seconds per run, 10), BENCH_C1 (32),
BENCH_C64 (8), BENCH_WRK_THREADS (2), BENCH_CLUSTER_ROUNDS (2),
BENCH_CONVERGE_DEPLOYS (20), BENCH_CONVERGE_DEFAULTS (60),
BENCH_CONVERGE_POLL (20: changes measured on the poll alone).
Prints a table and writes bench/out/cluster.json. Exits non-zero when
something breaks or a server answers errors, not when a target is missed.
"""
import argparse
import gzip
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import requests

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "bench" / "out"
BODIES = OUT / "cluster"
MODEL = REPO / "examples" / "fashion_mnist" / "model.pt"
CONFIG = json.loads((REPO / "examples" / "fashion_mnist" / "model.json").read_text())
sys.path.insert(0, str(REPO / "tests" / "e2e"))
from pg import PGBIN, PgCluster, _free_port  # noqa: E402

DURATION = int(os.environ.get("BENCH_DURATION", "10"))
C1 = int(os.environ.get("BENCH_C1", "32"))
C64 = int(os.environ.get("BENCH_C64", "8"))
WRK_THREADS = int(os.environ.get("BENCH_WRK_THREADS", "2"))
ROUNDS = int(os.environ.get("BENCH_CLUSTER_ROUNDS", "2"))
N_DEPLOYS = int(os.environ.get("BENCH_CONVERGE_DEPLOYS", "20"))
N_DEFAULTS = int(os.environ.get("BENCH_CONVERGE_DEFAULTS", "60"))
N_POLL = int(os.environ.get("BENCH_CONVERGE_POLL", "20"))


def log(msg):
    print(f"cluster: {msg}", file=sys.stderr, flush=True)


class Modeld:
    def __init__(self, binary, store, args=(), name="modeld"):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = OUT / f"cluster-{name}.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("MODELD_")}
        env["OPENBLAS_NUM_THREADS"] = "1"
        self.proc = subprocess.Popen(
            [binary, "--host", "127.0.0.1", "--port", str(self.port), "--store", str(store),
             "--access-log", "off", "--drain-seconds", "0", *map(str, args)],
            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=open(self.log, "wb"))
        deadline = time.monotonic() + 60
        while True:
            if self.proc.poll() is not None:
                sys.exit(f"{name} exited while starting; see {self.log}")
            try:
                if requests.get(self.url + "/readyz", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                sys.exit(f"{name} not ready within 60 s; see {self.log}")
            time.sleep(0.05)

    def deploy(self, name="fashion", **fields):
        form = {"config": json.dumps(CONFIG), **fields}
        with open(MODEL, "rb") as f:
            r = requests.post(self.url + f"/models/{name}/versions", data=form,
                              files={"checkpoint": f}, timeout=120)
        if r.status_code != 201:
            sys.exit(f"deploy {name} answered {r.status_code}: {r.text}")
        return r.json()["version"]

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(15)

    def cpu_s(self):
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def make_bodies():
    BODIES.mkdir(parents=True, exist_ok=True)
    with gzip.open("/usr/share/datasets/fashion-mnist/t10k-images-idx3-ubyte.gz") as f:
        images = np.frombuffer(f.read()[16:], dtype=np.uint8).reshape(-1, 784)
    with open(BODIES / "json1_int.json", "w") as f:
        json.dump({"instances": images[:1].tolist()}, f, separators=(",", ":"))
    np.save(BODIES / "npy64.npy", images[:64].astype(np.float32))
    return (BODIES / "json1_int.json").read_bytes()


def wrk(name, lua, srv, conns):
    log(f"wrk {name}: -t{WRK_THREADS} -c{conns} -d{DURATION}s")
    cpu0 = srv.cpu_s()
    env = {**os.environ, "BENCH_BODY_DIR": str(BODIES)}
    p = subprocess.run(["wrk", f"-t{WRK_THREADS}", f"-c{conns}", f"-d{DURATION}s", "--latency",
                        "-s", str(REPO / "bench" / lua), srv.url], env=env,
                       capture_output=True, text=True, timeout=DURATION + 60)
    (OUT / f"cluster-{name}.wrk.txt").write_text(p.stdout + p.stderr)
    line = next((l for l in p.stdout.splitlines() if l.startswith("BENCH_JSON ")), None)
    if p.returncode != 0 or line is None:
        sys.exit(f"wrk {name} failed; see {OUT}/cluster-{name}.wrk.txt")
    r = json.loads(line[len("BENCH_JSON "):])
    r["server_cpu_cores"] = round((srv.cpu_s() - cpu0) / r["duration_s"], 2)
    r["non2xx"] = "Non-2xx" in p.stdout
    return r


def pg_transactions(pg, db):
    # the cumulative statistics are flushed by each backend within a second
    time.sleep(1.5)
    return int(pg.psql("SELECT xact_commit + xact_rollback FROM pg_stat_database "
                       f"WHERE datname = '{db}'"))


def online(binary, pg, tmp):
    url = pg.new_database()
    db = url.rsplit("/", 1)[1]
    servers = {"single-host (SQLite)": Modeld(binary, tmp / "single", name="single"),
               "cluster (PostgreSQL)": Modeld(binary, tmp / "cluster", ["--index-url", url],
                                              name="cluster")}
    results = {label: {"json1": [], "npy64": []} for label in servers}
    try:
        for srv in servers.values():
            srv.deploy()
        for rnd in range(ROUNDS):
            for label, srv in servers.items():
                tag = "single" if "SQLite" in label else "cluster"
                for key, lua, conns in (("json1", "post_json1.lua", C1),
                                        ("npy64", "post_npy64.lua", C64)):
                    x0 = pg_transactions(pg, db) if tag == "cluster" else None
                    r = wrk(f"{tag}-{key}-{rnd + 1}", lua, srv, conns)
                    if x0 is not None:
                        r["pg_transactions"] = pg_transactions(pg, db) - x0
                    results[label][key].append(r)
        # the predict path needs no index: the same load with PostgreSQL stopped
        log("stopping PostgreSQL for the last cluster-mode run")
        pg.stop("fast")
        try:
            srv = servers["cluster (PostgreSQL)"]
            label = "cluster, PostgreSQL stopped"
            results[label] = {"json1": [wrk("cluster-pgdown-json1", "post_json1.lua", srv, C1)],
                              "npy64": [wrk("cluster-pgdown-npy64", "post_npy64.lua", srv, C64)]}
            r = requests.post(srv.url + "/models/fashion/versions", timeout=60,
                              files={"checkpoint": open(MODEL, "rb")},
                              data={"config": json.dumps(CONFIG)})
            results[label]["deploy_status"] = r.status_code
            results[label]["deploy_error"] = (r.json().get("error", {}).get("code")
                                              if r.status_code != 201 else None)
        finally:
            pg.start()
    finally:
        for srv in servers.values():
            srv.stop()
    return results


def percentile(xs, q):
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summary(xs):
    ms = [1000 * x for x in xs]
    return {"n": len(ms), "p50_ms": percentile(ms, 50), "p90_ms": percentile(ms, 90),
            "p99_ms": percentile(ms, 99), "max_ms": max(ms) if ms else float("nan")}


def converge(binary, store, a_args, b_args, body, n_deploys, n_defaults, what):
    """Changes through A, timed until B serves them. Returns the samples."""
    log(f"convergence ({what}): {n_deploys} deploys and {n_defaults} default changes")
    a = Modeld(binary, store, a_args, name=f"converge-a-{what}")
    b = Modeld(binary, store, b_args, name=f"converge-b-{what}")
    session = requests.Session()
    samples = {"deploy": {"from_ack": [], "from_send": []},
               "default": {"from_ack": [], "from_send": []}}

    def b_version():
        r = session.post(b.url + "/models/fashion/predict", data=body, timeout=30,
                         headers={"Content-Type": "application/json"})
        return r.json()["version"] if r.status_code == 200 else None

    def wait_b(version, t_send, t_ack, kind):
        deadline = time.monotonic() + 60
        while b_version() != version:
            if time.monotonic() > deadline:
                sys.exit(f"replica B did not serve version {version} within 60 s ({what})")
        t = time.monotonic()
        samples[kind]["from_ack"].append(max(0.0, t - t_ack))
        samples[kind]["from_send"].append(t - t_send)

    try:
        current = a.deploy()
        wait_b(current, time.monotonic(), time.monotonic(), "deploy")
        samples["deploy"] = {"from_ack": [], "from_send": []}  # the first load is not a change
        for _ in range(n_deploys):
            t_send = time.monotonic()
            current = a.deploy()
            t_ack = time.monotonic()
            wait_b(current, t_send, t_ack, "deploy")
        versions = list(range(1, current + 1))
        for i in range(n_defaults):
            target = versions[i % len(versions)]
            if target == current:
                target = versions[(i + 1) % len(versions)]
            t_send = time.monotonic()
            r = requests.patch(a.url + "/models/fashion", json={"default_version": target},
                               timeout=60)
            t_ack = time.monotonic()
            if r.status_code != 200:
                sys.exit(f"default change answered {r.status_code}: {r.text}")
            wait_b(target, t_send, t_ack, "default")
            current = target
    finally:
        a.stop()
        b.stop()
    return {kind: {k: summary(v) for k, v in s.items()} for kind, s in samples.items()}


def median_of(runs, key, sub=None):
    vals = [r[key][sub] if sub else r[key] for r in runs]
    return statistics.median(vals)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--modeld", default=str(REPO / "modeld"))
    args = ap.parse_args()
    binary = args.modeld
    if not (PGBIN / "initdb").exists() or not shutil.which("psql"):
        sys.exit(f"PostgreSQL 15 is not installed in {PGBIN} (make deps installs postgresql-15)")
    if not shutil.which("wrk"):
        sys.exit("wrk is not installed (make deps)")
    OUT.mkdir(parents=True, exist_ok=True)
    body = make_bodies()
    load0 = open("/proc/loadavg").read().split()[:3]
    pg = PgCluster()
    tmp = Path(tempfile.mkdtemp(prefix="modeld-cluster-bench-"))
    try:
        pg.init()
        log(f"PostgreSQL 15 on 127.0.0.1:{pg.port}")
        on = online(binary, pg, tmp)
        url = pg.new_database()
        notify = converge(binary, tmp / "conv-pg",
                          ["--index-url", url, "--store-poll-ms", "60000"],
                          ["--index-url", url, "--store-poll-ms", "60000"],
                          body, N_DEPLOYS, N_DEFAULTS, "notify")
        poll = converge(binary, tmp / "conv-sqlite", ["--store-poll-ms", "1000"],
                        ["--store-poll-ms", "1000"], body, max(1, N_POLL // 4),
                        N_POLL - max(1, N_POLL // 4), "poll")
    finally:
        pg.destroy()
        shutil.rmtree(tmp, ignore_errors=True)

    try:
        cpu = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo")
                   if l.startswith("model name"))
    except (OSError, StopIteration):
        cpu = platform.processor()
    pg_version = subprocess.run([str(PGBIN / "postgres"), "--version"], capture_output=True,
                                text=True).stdout.strip()
    results = {"when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "machine": {"cores": os.cpu_count(), "cpu": cpu, "kernel": platform.release(),
                           "loadavg_at_start": load0,
                           "loadavg_at_end": open("/proc/loadavg").read().split()[:3]},
               "postgresql": pg_version, "duration_s": DURATION, "rounds": ROUNDS,
               "online": on, "convergence": {"notify": notify, "poll_sqlite": poll}}
    json.dump(results, open(OUT / "cluster.json", "w"), indent=1)

    print()
    print(f"online, same model and wrk load ({DURATION} s runs, median of {ROUNDS} rounds; "
          f"machine: {os.cpu_count()} cores, {cpu})")
    head = ["mode", "load", "req/s", "p50 ms", "p99 ms", "srv cpu", "PG xacts/run"]
    rows = []
    errors = []
    for label, r in on.items():
        for key, conns in (("json1", C1), ("npy64", C64)):
            runs = r[key]
            for x in runs:
                if any(x["errors"].values()) or x["non2xx"]:
                    errors.append(f"{label} {key}: {x['errors']}")
            xacts = [x["pg_transactions"] for x in runs if "pg_transactions" in x]
            rows.append([label, f"{'1-row JSON' if key == 'json1' else '64-row NPY'} "
                         f"{conns} conn", f"{median_of(runs, 'req_per_s'):.0f}",
                         f"{median_of(runs, 'latency_ms', 'p50'):.2f}",
                         f"{median_of(runs, 'latency_ms', 'p99'):.2f}",
                         f"{median_of(runs, 'server_cpu_cores'):.2f}",
                         f"{statistics.median(xacts):.0f}" if xacts else "-"])
    w = [max(len(str(x[i])) for x in rows + [head]) for i in range(len(head))]
    fmt = lambda x: "  ".join(str(c).ljust(w[i]) if i < 2 else str(c).rjust(w[i])
                              for i, c in enumerate(x))
    print(fmt(head))
    print("  ".join("-" * n for n in w))
    for x in rows:
        print(fmt(x))
    down = on["cluster, PostgreSQL stopped"]
    print(f"a deploy while PostgreSQL was stopped answered {down['deploy_status']} "
          f"{down['deploy_error'] or ''}")
    print()
    print("convergence: a change through replica A until replica B answers with it (ms)")
    head = ["mechanism", "change", "n", "p50", "p90", "p99", "max", "p99 from send"]
    rows = []
    for label, conv in (("NOTIFY (PostgreSQL)", notify), ("poll 1 s (SQLite)", poll)):
        for kind in ("deploy", "default"):
            s, t = conv[kind]["from_ack"], conv[kind]["from_send"]
            rows.append([label, kind, s["n"], f"{s['p50_ms']:.1f}", f"{s['p90_ms']:.1f}",
                         f"{s['p99_ms']:.1f}", f"{s['max_ms']:.1f}", f"{t['p99_ms']:.1f}"])
    w = [max(len(str(x[i])) for x in rows + [head]) for i in range(len(head))]
    print(fmt(head))
    print("  ".join("-" * n for n in w))
    for x in rows:
        print(fmt(x))
    print("(from A's answer; \"from send\": from the moment the request to A was sent)")
    print(f"\nraw numbers: {OUT / 'cluster.json'}")
    if errors:
        print(f"\nERRORS during load (numbers invalid): {errors}")
        sys.exit(1)


if __name__ == "__main__":
    main()
