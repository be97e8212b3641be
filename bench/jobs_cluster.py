#!/usr/bin/python3
"""
jobs_cluster.py - one batch job over every replica, measured (`make bench`,
issue 26).

Against a throwaway PostgreSQL 15 (tests/e2e/pg.py) and s3rver behind the
SigV4-checking proxy (tests/e2e/s3.py), on loopback:

1. a BENCH_JOB_ROWS-row NPY dataset in S3 (float32 [rows, 4]; 1,000,000
   rows by default), one job NPY in, NPY out, both in S3, through two models:
   `mlp` (tests/fixtures/mlp.pt, 4 -> 3: the job is all I/O and fixed
   costs) and `wide` (4 -> 512 -> 512 -> 3, made here: compute dominates),
     - single-host mode: modeld on its SQLite index (one runner streams it);
     - cluster mode with 1, 2 and 3 replicas on one PostgreSQL (chunks);
   rows/s from POST /jobs until the job reads succeeded (plan, chunks,
   assembly and the output's upload included), each mode BENCH_JOB_ROUNDS
   times (median). On two cores the sum cannot grow with replicas: the
   figure to read is cluster mode's overhead against the single-host job
   over the same file (target: within 10 %).
2. the chunk claim rate: a job of BENCH_CLAIM_CHUNKS chunks of one batch
   each over 3 replicas: chunks finished per second, claim, compute, part
   upload and fenced finish included.

    /usr/bin/python3 bench/jobs_cluster.py [--modeld ./modeld]

Prints a table and writes bench/out/jobs_cluster.json. Exits non-zero when a
job fails or its output differs from the single-host one.
"""
import argparse
import io
import json
import os
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
MODEL = REPO / "tests" / "fixtures" / "mlp.pt"
CONFIG = {"input": {"shape": [4]}, "output": "logits"}
# the compute-bound job: the same rows through 4 -> 512 -> 512 -> 3 (264k
# multiply-adds a row, ~60x the tiny MLP's), made here with PyTorch
WIDE = 512
sys.path.insert(0, str(REPO / "tests" / "e2e"))
from pg import PgCluster, _free_port  # noqa: E402
from s3 import S3Harness  # noqa: E402

ROWS = int(os.environ.get("BENCH_JOB_ROWS", "1000000"))
ROUNDS = int(os.environ.get("BENCH_JOB_ROUNDS", "2"))
BATCH = int(os.environ.get("BENCH_JOB_BATCH", "4096"))
CLAIM_CHUNKS = int(os.environ.get("BENCH_CLAIM_CHUNKS", "400"))


def log(msg):
    print(f"jobs_cluster: {msg}", file=sys.stderr, flush=True)


class Modeld:
    def __init__(self, binary, store, env, args=(), name="modeld"):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(OUT / f"jobs-cluster-{name}.log", "wb")
        e = {k: v for k, v in os.environ.items() if not k.startswith(("MODELD_", "AWS_"))}
        e.update(env)
        e["OPENBLAS_NUM_THREADS"] = "1"
        self.proc = subprocess.Popen([binary, "--host", "127.0.0.1", "--port", str(self.port),
                                      "--store", str(store), *args], env=e, stdout=self.log,
                                     stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while True:
            try:
                if requests.get(self.url + "/readyz", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"modeld {name} did not start; see {self.log.name}")
            time.sleep(0.05)

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def make_wide(path):
    import torch
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, WIDE), torch.nn.ReLU(),
                              torch.nn.Linear(WIDE, WIDE), torch.nn.ReLU(),
                              torch.nn.Linear(WIDE, 3)).eval()
    torch.jit.script(net).save(str(path))


def deploy(srv, models):
    for name, path in models.items():
        with open(path, "rb") as f:
            r = requests.post(srv.url + f"/models/{name}/versions", files={"checkpoint": f},
                              data={"config": json.dumps(CONFIG)}, timeout=60)
        r.raise_for_status()


def run_job(srv, spec):
    t0 = time.monotonic()
    r = requests.post(srv.url + "/jobs", json=spec, timeout=30)
    if r.status_code != 202:
        raise RuntimeError(f"POST /jobs: {r.status_code} {r.text}")
    jid = r.json()["id"]
    while True:
        job = requests.get(srv.url + f"/jobs/{jid}", timeout=30).json()
        if job["status"] in ("succeeded", "failed", "cancelled"):
            break
        time.sleep(0.01)
    dt = time.monotonic() - t0
    if job["status"] != "succeeded":
        raise RuntimeError(f"job {jid}: {job}")
    return dt, job


def metric(srv, name):
    for line in requests.get(srv.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--modeld", default=str(REPO / "modeld"))
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="modeld-jobs-cluster-"))
    pg = PgCluster()
    pg.init()
    (tmp / "s3").mkdir()
    s3h = S3Harness(tmp / "s3")
    s3h.start()
    results = {"rows": ROWS, "batch": BATCH, "rounds": ROUNDS, "modes": {}}
    servers = []
    try:
        rng = np.random.default_rng(0)
        data = rng.standard_normal((ROWS, 4), dtype=np.float32)
        buf = io.BytesIO()
        np.save(buf, data)
        c = s3h.client()
        c.put_object(Bucket=s3h.bucket, Key="data/big.npy", Body=buf.getvalue())
        log(f"{ROWS} rows ({len(buf.getvalue()) >> 20} MiB) put in S3")
        env = s3h.env()
        env["MD_TEST_S3_STALL_S"] = "30"
        allowed = ("--allowed-s3", f"{s3h.bucket}/data,{s3h.bucket}/out")
        models = {"mlp": MODEL, "wide": tmp / "wide.pt"}
        make_wide(models["wide"])
        n = [0]

        def spec(model, extra=None):
            n[0] += 1
            s = {"model": model, "batch_size": BATCH,
                 "input": {"path": f"s3://{s3h.bucket}/data/big.npy", "format": "npy"},
                 "output": {"path": f"s3://{s3h.bucket}/out/o{n[0]}.npy", "format": "npy"}}
            s.update(extra or {})
            return s

        def out_bytes(job):
            key = job["spec"]["output"]["path"].split("/", 3)[3]
            return c.get_object(Bucket=s3h.bucket, Key=key)["Body"].read()

        # single host: each model's job, its output the reference
        single = Modeld(args.modeld, tmp / "single", env, allowed, "single")
        servers.append(single)
        deploy(single, models)
        reference = {}
        for model in models:
            times = []
            for _ in range(ROUNDS):
                dt, job = run_job(single, spec(model))
                times.append(dt)
                reference[model] = reference.get(model) or out_bytes(job)
            results["modes"][f"{model} single-host"] = {
                "seconds": times, "rows_per_s": ROWS / statistics.median(times)}
            log(f"{model} single-host: {ROWS / statistics.median(times):.0f} rows/s")
        single.stop()
        servers.remove(single)

        for replicas in (1, 2, 3):
            url = pg.new_database()
            reps = []
            for i in range(replicas):
                reps.append(Modeld(args.modeld, tmp / f"c{replicas}-{i}", env,
                                   ("--index-url", url, "--blob-url",
                                    f"s3://{s3h.bucket}/modeld{replicas}", "--max-jobs", "1",
                                    *allowed), f"cluster{replicas}-{i}"))
                servers.append(reps[-1])
            deploy(reps[0], models)
            for r in reps[1:]:  # every replica has the models loaded before the clock starts
                for model in models:
                    deadline = time.monotonic() + 60
                    while requests.post(r.url + f"/models/{model}/predict", json=[[0, 0, 0, 0]],
                                        timeout=10).status_code != 200:
                        if time.monotonic() > deadline:
                            raise RuntimeError("a replica never loaded the model")
                        time.sleep(0.05)
            for model in models:
                before = [metric(r, "modeld_job_chunks_finished_total") for r in reps]
                times = []
                for _ in range(ROUNDS):
                    dt, job = run_job(reps[0], spec(model))
                    times.append(dt)
                    if out_bytes(job) != reference[model]:
                        raise RuntimeError(f"{model}, {replicas} replicas: the output differs "
                                           "from single-host")
                finished = [metric(r, "modeld_job_chunks_finished_total") - b
                            for r, b in zip(reps, before)]
                results["modes"][f"{model} cluster-{replicas}"] = {
                    "seconds": times, "rows_per_s": ROWS / statistics.median(times),
                    "chunks": job["chunks"]["total"],
                    "chunks_finished_per_replica": finished}
                log(f"{model} cluster, {replicas} replica(s): "
                    f"{ROWS / statistics.median(times):.0f} rows/s, {job['chunks']['total']} "
                    f"chunks a job, finished per replica {finished}")
            if replicas == 3:
                # the claim rate: one-batch chunks
                small = spec("mlp", {"batch_size": 256, "chunk_rows": 256})
                rows_small = 256 * CLAIM_CHUNKS
                c.put_object(Bucket=s3h.bucket, Key="data/small.npy",
                             Body=(lambda b: (np.save(b, data[:rows_small]), b.getvalue())[1])(
                                 io.BytesIO()))
                small["input"]["path"] = f"s3://{s3h.bucket}/data/small.npy"
                dt, job = run_job(reps[0], small)
                results["claim"] = {"chunks": job["chunks"]["total"], "seconds": dt,
                                    "chunks_per_s": job["chunks"]["total"] / dt}
                log(f"claim rate: {job['chunks']['total']} chunks in {dt:.2f} s = "
                    f"{job['chunks']['total'] / dt:.0f} chunks/s (3 replicas)")
            for r in reps:
                r.stop()
                servers.remove(r)
    finally:
        for srv in servers:
            srv.stop()
        s3h.stop()
        pg.destroy()
    print(f"\n1M-row NPY job in S3 ({ROWS} rows, batch {BATCH}; median of {ROUNDS}): "
          "mlp = tests/fixtures/mlp.pt (4 -> 3), wide = 4 -> 512 -> 512 -> 3")
    print(f"{'mode':<20} {'rows/s':>10} {'vs single-host':>15} {'chunks':>7}  finished per replica")
    for mode, r in results["modes"].items():
        base = results["modes"][mode.split()[0] + " single-host"]["rows_per_s"]
        print(f"{mode:<20} {r['rows_per_s']:>10.0f} {100 * (r['rows_per_s'] / base - 1):>+14.1f}% "
              f"{r.get('chunks', ''):>7}  {r.get('chunks_finished_per_replica', '')}")
    if "claim" in results:
        cl = results["claim"]
        print(f"chunk claim rate: {cl['chunks_per_s']:.0f} chunks/s ({cl['chunks']} one-batch "
              f"chunks, 3 replicas, claim + compute + part upload + fenced finish)")
    (OUT / "jobs_cluster.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
