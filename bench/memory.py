#!/usr/bin/python3
"""
memory.py - what a loaded version costs in memory (`make bench`, issue 24).

For a ~200 MB TorchScript MLP (4096-wide linears, the model of issue 24) and
the FashionMNIST MLP, at 1, 2 and 16 workers: start modeld (temporary store,
loopback), read its VmRSS once ready, deploy the model with `workers` N, send
it enough concurrent requests that every online worker forwards (and one
small job, so the job workers forward too), then read VmRSS again. The
difference is the version's cost; the target is <= 1.25 x its weight bytes +
32 MB. Beside it: the same model in-process in PyTorch (the interpreter and
libraries included, as a FastAPI server would hold it), and a second,
non-default deploy of the same bytes.

    /usr/bin/python3 bench/memory.py [--modeld ./modeld] [--workers 1,2,16]

Prints a table and writes bench/out/memory.json. Exits non-zero when
something breaks, not when a target is missed.
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "bench" / "out"
PY = "/usr/bin/python3"

MAKE_BIG = r"""
import sys, torch
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.ReLU(),
                        torch.nn.Linear(4096, 4096), torch.nn.ReLU(),
                        torch.nn.Linear(4096, 4096), torch.nn.ReLU(),
                        torch.nn.Linear(4096, 10)).eval()
torch.jit.script(m).save(sys.argv[1])
"""

INPROC = r"""
import sys, os, torch
torch.set_num_threads(1)
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
base = rss()
m = torch.jit.load(sys.argv[1]).eval()
width = int(sys.argv[2])
with torch.no_grad():
    for b in (1, 8, 64):
        m(torch.rand(b, width))
print(rss(), base)
"""


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def status_bytes(pid, key):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def weight_bytes(path):
    out = subprocess.run([PY, "-c", "import sys, torch; m = torch.jit.load(sys.argv[1]); "
                          "print(sum(t.numel() * t.element_size() for t in "
                          "list(m.parameters()) + list(m.buffers())))", str(path)],
                         check=True, capture_output=True, text=True, timeout=300)
    return int(out.stdout.strip())


class Modeld:
    def __init__(self, binary, store, workers):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("MODELD_")}
        env["OPENBLAS_NUM_THREADS"] = "1"
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--store", store, "--workers", str(workers),
             "--allowed-paths", store, "--access-log", "off"],
            env=env, stdout=subprocess.DEVNULL, stderr=open(Path(store) / "stderr", "w"))
        deadline = time.monotonic() + 60
        while True:
            try:
                if requests.get(self.url + "/readyz", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"modeld did not start: {(Path(store) / 'stderr').read_text()}")
            time.sleep(0.1)

    def rss(self):
        return status_bytes(self.proc.pid, "VmRSS")

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def deploy(srv, name, model, config, default=True):
    with open(model, "rb") as f:
        r = requests.post(srv.url + f"/models/{name}/versions" +
                          ("" if default else "?make_default=false"),
                          files={"checkpoint": f}, data={"config": json.dumps(config)},
                          timeout=600)
    if r.status_code != 201:
        raise SystemExit(f"deploy {name}: {r.status_code} {r.text}")
    return r.json()["version"]


def exercise(srv, name, version, width, workers, store):
    """Concurrent requests so every online worker forwards, then a small job
    so the job workers do too."""
    row = [0.5] * width
    errors = []

    def one(rows):
        r = requests.post(srv.url + f"/models/{name}/versions/{version}/predict",
                          json=[row] * rows, timeout=300)
        if r.status_code != 200:
            errors.append(r.text)

    for rows in (1, 8, 64):
        ts = [threading.Thread(target=one, args=(rows,)) for _ in range(max(2, 2 * workers))]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    data = Path(store) / f"{name}.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for _ in range(256)))
    r = requests.post(srv.url + "/jobs", json={"model": name, "version": version,
                                               "input": {"path": str(data), "format": "jsonl"},
                                               "batch_size": 32}, timeout=30)
    if r.status_code != 202:
        errors.append(r.text)
    else:
        jid = r.json()["id"]
        while requests.get(srv.url + f"/jobs/{jid}", timeout=30).json()["status"] in (
                "queued", "running"):
            time.sleep(0.1)
    if errors:
        raise SystemExit(f"{name}: {len(errors)} requests failed: {errors[0][:300]}")


def settle(srv):
    """VmRSS once it stops moving (freed memory handed back, threads parked)."""
    last = srv.rss()
    for _ in range(20):
        time.sleep(0.25)
        now = srv.rss()
        if abs(now - last) < 1 << 20:
            return now
        last = now
    return last


def measure(binary, model, width, workers, second):
    with tempfile.TemporaryDirectory(prefix="md-mem-") as store:
        srv = Modeld(binary, store, workers)
        try:
            idle = settle(srv)
            cfg = {"input": {"shape": [width]}, "workers": workers}
            v = deploy(srv, "m", model, cfg)
            exercise(srv, "m", v, width, workers, store)
            one = settle(srv)
            res = {"idle": idle, "one": one}
            if second:
                v2 = deploy(srv, "m", model, cfg, default=False)
                res["after_second_deploy"] = settle(srv)
                exercise(srv, "m", v2, width, workers, store)
                res["two_used"] = settle(srv)
            res["hwm"] = status_bytes(srv.proc.pid, "VmHWM")
            return res
        finally:
            srv.stop()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--modeld", default=str(REPO / "modeld"))
    ap.add_argument("--workers", default="1,2,16")
    ap.add_argument("--skip-big", action="store_true")
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    big = OUT / "mlp4096.pt"
    if not big.exists():
        subprocess.run([PY, "-c", MAKE_BIG, str(big)], check=True, timeout=600)
    models = [("fashion", REPO / "examples" / "fashion_mnist" / "model.pt", 784)]
    if not args.skip_big:
        models.append(("mlp4096", big, 4096))
    results = {}
    print(f"{'model':10} {'weights':>9} {'workers':>7} {'idle':>8} {'+version':>9} "
          f"{'x weights':>9} {'target':>9} {'2nd deploy':>10} {'2 used':>9}")
    for name, path, width in models:
        wb = weight_bytes(path)
        inproc = subprocess.run([PY, "-c", INPROC, str(path), str(width)], check=True,
                                capture_output=True, text=True, timeout=600).stdout.split()
        results[name] = {"weight_bytes": wb, "inprocess_rss": int(inproc[0]),
                         "inprocess_rss_before_load": int(inproc[1]), "workers": {}}
        for n in [int(w) for w in args.workers.split(",")]:
            r = measure(args.modeld, path, width, n, second=n == 2)
            results[name]["workers"][n] = r
            cost = r["one"] - r["idle"]
            target = 1.25 * wb + 32 * 2**20
            second = (f"{(r['after_second_deploy'] - r['one']) / 2**20:9.0f}M"
                      if "after_second_deploy" in r else f"{'':>10}")
            used = (f"{(r['two_used'] - r['idle']) / 2**20:8.0f}M" if "two_used" in r
                    else f"{'':>9}")
            print(f"{name:10} {wb / 2**20:8.1f}M {n:7d} {r['idle'] / 2**20:7.0f}M "
                  f"{cost / 2**20:8.1f}M {cost / wb:9.2f} {target / 2**20:8.0f}M {second} {used}",
                  flush=True)
        print(f"{name:10} in-process PyTorch (python3 + torch + the model): "
              f"{int(inproc[0]) / 2**20:.0f} MB ({int(inproc[1]) / 2**20:.0f} MB before the load)")
    (OUT / "memory.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
