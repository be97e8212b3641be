#!/usr/bin/python3
"""
soak.py - modeld under a long mixed load, watching its memory (`make soak`).

1. Starts modeld (a temp store, the FashionMNIST model deployed as `fashion`).
2. Measures capacity: closed-loop 1-row JSON predictions from CLIENTS keep-alive
   connections for CAPACITY_S seconds (this client is Python on the same cores:
   the figure is what it can drive, which it says).
3. Soaks for SECONDS at 80% of that rate (paced, open loop), while a deploy and a
   delete of another version happen every DEPLOY_EVERY_S seconds and a batch job
   over the 10k FashionMNIST test set runs every JOB_EVERY_S seconds. Every
   answer must be 200 (or the designed 503 when a queue is full); every job
   must succeed with the known accuracy.
4. Samples the server's RSS every 5 s: after WARMUP_S, it must stay within 10%
   of its value at the end of warm-up.
5. 100 deploy / predict / delete cycles of one model: RSS afterwards within 10%
   of before (TorchScript unload leaks are a known complaint against servers).

Prints a summary and exits 1 when a check fails. Loopback only, bounded in time.
"""
import argparse
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "fashion_mnist"
DATASET = "/usr/share/datasets/fashion-mnist"
ROW = (EXAMPLE / "row.json").read_bytes()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


class Client:
    """One keep-alive connection."""

    def __init__(self, port):
        self.port = port
        self.conn = None

    def request(self, method, path, body=None, headers=None):
        for attempt in (0, 1):
            if self.conn is None:
                self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
            try:
                self.conn.request(method, path, body=body, headers=headers or {})
                r = self.conn.getresponse()
                data = r.read()
                if r.getheader("Connection", "").lower() == "close":
                    self.conn.close()
                    self.conn = None
                return r.status, data
            except (http.client.HTTPException, OSError):
                self.conn.close()
                self.conn = None
                if attempt:
                    raise
        raise AssertionError("unreachable")


def multipart(fields, files):
    boundary = "modeldsoak" + os.urandom(8).hex()
    out = b""
    for k, v in fields.items():
        out += (f"--{boundary}\r\nContent-Disposition: form-data; name=\"{k}\"\r\n\r\n"
                f"{v}\r\n").encode()
    for k, (name, data) in files.items():
        out += (f"--{boundary}\r\nContent-Disposition: form-data; name=\"{k}\"; "
                f"filename=\"{name}\"\r\nContent-Type: application/octet-stream\r\n\r\n").encode()
        out += data + b"\r\n"
    out += f"--{boundary}--\r\n".encode()
    return out, {"Content-Type": f"multipart/form-data; boundary={boundary}"}


def deploy(c, name, **fields):
    body, headers = multipart({"config": (EXAMPLE / "model.json").read_text(), **fields},
                              {"checkpoint": ("model.pt", (EXAMPLE / "model.pt").read_bytes())})
    st, data = c.request("POST", f"/models/{name}/versions", body, headers)
    assert st == 201, (st, data[:300])
    return json.loads(data)["version"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--modeld", default=str(REPO / "modeld"))
    ap.add_argument("--seconds", type=float, default=300)
    ap.add_argument("--warmup", type=float, default=60)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--capacity-seconds", type=float, default=8)
    ap.add_argument("--deploy-every", type=float, default=10)
    ap.add_argument("--job-every", type=float, default=60)
    ap.add_argument("--cycles", type=int, default=100)
    args = ap.parse_args()

    tmp = tempfile.mkdtemp(prefix="modeld-soak-")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MODELD_")}
    env["OPENBLAS_NUM_THREADS"] = "1"
    log = open(os.path.join(tmp, "modeld.log"), "wb")
    proc = subprocess.Popen([args.modeld, "--port", str(port), "--store", tmp + "/store",
                             "--access-log", "off", "--allowed-paths", f"{DATASET},{tmp}",
                             "--drain-seconds", "0"], env=env, stdout=log, stderr=log)
    failures = []
    try:
        c = Client(port)
        deadline = time.monotonic() + 30
        while True:
            try:
                if c.request("GET", "/readyz")[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "modeld did not become ready"
            time.sleep(0.1)
        deploy(c, "fashion")

        # ---- capacity: closed loop
        counts = [0] * args.clients
        stop = time.monotonic() + args.capacity_seconds

        def closed(i):
            cl = Client(port)
            while time.monotonic() < stop:
                st, _ = cl.request("POST", "/models/fashion/predict", ROW)
                counts[i] += st == 200

        ts = [threading.Thread(target=closed, args=(i,)) for i in range(args.clients)]
        [t.start() for t in ts]
        [t.join() for t in ts]
        capacity = sum(counts) / args.capacity_seconds
        rate = 0.8 * capacity
        print(f"capacity (this Python client, {args.clients} connections): {capacity:.0f} req/s; "
              f"soak at {rate:.0f} req/s for {args.seconds:.0f} s", flush=True)

        # ---- soak: paced predictions, deploys, jobs, RSS samples
        statuses = {}
        lock = threading.Lock()
        t0 = time.monotonic()
        end = t0 + args.seconds
        per_client = rate / args.clients

        def paced(i):
            cl = Client(port)
            n = 0
            while True:
                due = t0 + n / per_client
                now = time.monotonic()
                if due >= end:
                    return
                if due > now:
                    time.sleep(due - now)
                try:
                    st, _ = cl.request("POST", "/models/fashion/predict", ROW)
                except OSError as e:
                    st = f"error {e.__class__.__name__}"
                with lock:
                    statuses[st] = statuses.get(st, 0) + 1
                n += 1

        def background():
            cl = Client(port)
            next_deploy, next_job, jobs = t0, t0 + 5, []
            while time.monotonic() < end:
                now = time.monotonic()
                if now >= next_deploy:
                    v = deploy(cl, "fashion", make_default="false")
                    st, data = cl.request("DELETE", f"/models/fashion/versions/{v}")
                    if st != 200:
                        failures.append(f"delete version {v}: {st} {data[:200]!r}")
                    next_deploy += args.deploy_every
                if now >= next_job:
                    out = os.path.join(tmp, f"job{len(jobs)}.jsonl")
                    spec = {"model": "fashion", "output": {"path": out, "format": "jsonl"},
                            "input": {"path": f"{DATASET}/t10k-images-idx3-ubyte.gz",
                                      "format": "idx",
                                      "label": f"{DATASET}/t10k-labels-idx1-ubyte.gz"}}
                    st, data = cl.request("POST", "/jobs", json.dumps(spec))
                    if st != 202:
                        failures.append(f"job: {st} {data[:200]!r}")
                    else:
                        jobs.append(json.loads(data)["id"])
                    next_job += args.job_every
                time.sleep(0.2)
            for jid in jobs:
                while True:
                    st, data = cl.request("GET", f"/jobs/{jid}")
                    job = json.loads(data)
                    if job["status"] not in ("queued", "running"):
                        break
                    time.sleep(0.5)
                if job["status"] != "succeeded" or job.get("correct") != 8675:
                    failures.append(f"job {jid}: {job['status']} correct={job.get('correct')} "
                                    f"error={job.get('error')}")
            print(f"jobs: {len(jobs)} run beside the load, each 8675/10000 correct"
                  if not any(f.startswith("job") for f in failures) else "jobs: FAILED", flush=True)

        samples = []

        def sampler():
            while time.monotonic() < end:
                samples.append((time.monotonic() - t0, rss_kib(proc.pid)))
                time.sleep(5)

        ts = [threading.Thread(target=paced, args=(i,)) for i in range(args.clients)]
        ts += [threading.Thread(target=background), threading.Thread(target=sampler)]
        [t.start() for t in ts]
        [t.join() for t in ts]
        total = sum(statuses.values())
        print(f"predictions: {total} in {args.seconds:.0f} s ({total / args.seconds:.0f} req/s): "
              f"{statuses}", flush=True)
        bad = {k: v for k, v in statuses.items() if k not in (200, 503)}
        if bad:
            failures.append(f"answers other than 200/503: {bad}")
        after = [r for t, r in samples if t >= args.warmup]
        if after:
            base = after[0]
            lo, hi = min(after), max(after)
            print(f"RSS after warm-up: {base / 1024:.1f} MiB at {args.warmup:.0f} s, "
                  f"min {lo / 1024:.1f}, max {hi / 1024:.1f} MiB "
                  f"({(hi - base) / base * 100:+.1f}% at most)", flush=True)
            if hi > base * 1.10 or lo < base * 0.90:
                failures.append(f"RSS moved more than 10% after warm-up: {after}")

        # ---- deploy / delete cycles
        before = rss_kib(proc.pid)
        for i in range(args.cycles):
            deploy(c, "cycle")
            st, _ = c.request("POST", "/models/cycle/predict", ROW)
            if st != 200:
                failures.append(f"cycle {i}: predict {st}")
            st, data = c.request("DELETE", "/models/cycle")
            if st != 200:
                failures.append(f"cycle {i}: delete {st} {data[:200]!r}")
        time.sleep(2)  # unloads finish once the workers drain
        after_cycles = rss_kib(proc.pid)
        print(f"{args.cycles} deploy/predict/delete cycles: RSS {before / 1024:.1f} -> "
              f"{after_cycles / 1024:.1f} MiB ({(after_cycles - before) / before * 100:+.1f}%)",
              flush=True)
        if after_cycles > before * 1.10:
            failures.append("RSS grew more than 10% over the deploy/delete cycles")
        if proc.poll() is not None:
            failures.append(f"modeld exited with {proc.returncode}")
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        log.close()
    for f in failures:
        print("FAIL", f)
    print("soak: " + ("FAILED" if failures else "passed") + f" (server log: {tmp}/modeld.log)")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
