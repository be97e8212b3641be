#!/usr/bin/env python3
"""
gpu_check.py - the CUDA path of a WITH_CUDA=1 modeld, checked on a machine
with a GPU. bench/gpu_check.sh builds the binary and runs this; it is not part
of `make test` (CI has no GPU).

Starts MODELD_BIN on a free loopback port and prints one PASS/FAIL/SKIP line
per check, then a throughput table. References are computed here with the
Python torch of the same machine, on the CPU, in float32:

  1. mlp.pt and cnn.pt deployed with device cuda, cuda:0 and auto (and cpu:
     a CUDA build must still serve CPU models); the committed fixtures and
     random inputs predicted, max abs diff <= TOL; the modeld process holds
     GPU memory (nvidia-smi);
  2. concurrent clients (threads, 1..64 rows each, random) batched on the GPU,
     every answer against the CPU reference; a version loaded, asked and
     unloaded 100 times gives its GPU memory back (nvidia-smi within 5 %);
  3. batch jobs on cuda models: mlp over tests/fixtures/datasets/small_f32.npy
     (NPY out) and, when the FashionMNIST test set is at FMNIST_DIR, the
     example model over its IDX.gz (accuracy must be PyTorch's 8675/10000,
     logits against the CPU reference);
  4. the FashionMNIST model on cuda over what clients send: 64 full-precision
     JSON rows (decoded on the pool), NPY in and out, the V2 binary tensor
     data extension (FP32, FP16) and KServe V1;
  5. throughput of 64-row NPY requests to the FashionMNIST example on cuda
     and on cpu (client processes, BENCH_SECONDS each).

Exit status: 0 when every check passed.
"""
import io
import json
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import requests
import torch

REPO = Path(__file__).resolve().parents[1]
FIX = REPO / "tests" / "fixtures"
EXAMPLE = REPO / "examples" / "fashion_mnist"
FMNIST_DIR = Path(os.environ.get("FMNIST_DIR", "/usr/share/datasets/fashion-mnist"))
TOL = float(os.environ.get("GPU_CHECK_TOL", "1e-4"))
BENCH_SECONDS = float(os.environ.get("BENCH_SECONDS", "10"))
BENCH_CLIENTS = int(os.environ.get("BENCH_CLIENTS", "8"))
# what the "cuda" models ask for; "cpu" tries this script's logic on a machine without a GPU
CUDA = os.environ.get("GPU_CHECK_DEVICE", "cuda")

MLP_CONFIG = {"input": {"shape": [4]}, "output": "logits"}
CNN_CONFIG = {"input": {"shape": [1, 8, 8]}}
FASHION_CONFIG = json.loads((EXAMPLE / "model.json").read_text())

failures = []


def report(ok, what, detail=""):
    tag = "PASS" if ok else "FAIL"
    if not ok:
        failures.append(what)
    print(f"{tag} {what}{': ' + detail if detail else ''}", flush=True)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Modeld:
    def __init__(self, tmp):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.stderr_path = Path(tmp) / "modeld.stderr"
        allowed = ",".join(str(p) for p in (FIX / "datasets", FMNIST_DIR, tmp))
        argv = [os.environ["MODELD_BIN"], "--host", "127.0.0.1", "--port", str(self.port),
                "--store", str(Path(tmp) / "store"), "--access-log", "off",
                "--drain-seconds", "0", "--allowed-paths", allowed]
        env = {k: v for k, v in os.environ.items() if not k.startswith("MODELD_")}
        env["OPENBLAS_NUM_THREADS"] = "1"
        self.proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL,
                                     stderr=open(self.stderr_path, "wb"))

    def stderr(self):
        return self.stderr_path.read_text(errors="replace")[-3000:]

    def wait_ready(self, timeout=60):
        deadline = time.monotonic() + timeout
        for probe in ("/healthz", "/readyz"):
            while True:
                if self.proc.poll() is not None:
                    return f"exited with {self.proc.returncode}: {self.stderr()}"
                try:
                    if requests.get(self.url + probe, timeout=1).status_code == 200:
                        break
                except requests.RequestException:
                    pass
                if time.monotonic() > deadline:
                    return f"{probe} not 200 within {timeout} s"
                time.sleep(0.05)
        return None

    def deploy(self, name, path, config):
        with open(path, "rb") as f:
            return requests.post(f"{self.url}/models/{name}/versions",
                                 files={"checkpoint": f}, data={"config": json.dumps(config)},
                                 timeout=120)

    def predict(self, name, rows, session=None):
        r = (session or requests).post(f"{self.url}/models/{name}/predict",
                                       json={"instances": rows}, timeout=60)
        if r.status_code != 200:
            raise RuntimeError(f"predict {name}: {r.status_code} {r.text[:300]}")
        return np.array(r.json()["predictions"], dtype=np.float32)

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def maxdiff(a, b):
    a = np.asarray(a, dtype=np.float32)
    b = np.asarray(b, dtype=np.float32)
    if a.shape != b.shape:
        return float("inf")
    return float(np.max(np.abs(a - b))) if a.size else 0.0


def cpu_ref(module, x):
    with torch.no_grad():
        return module(torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))).numpy()


def gpu_mib_of(pid):
    """GPU memory nvidia-smi attributes to `pid` (MiB), or None if it lists no such process."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True,
                             timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0] == str(pid):
            return int(parts[1])
    return None


def check_models(srv, refs):
    rng = np.random.default_rng(0)
    for tag, dev in (("cuda", CUDA), ("cuda0", "cuda:0"), ("auto", "auto"), ("cpu", "cpu")):
        for kind, config in (("mlp", MLP_CONFIG), ("cnn", CNN_CONFIG)):
            name = f"{kind}_{tag}"
            r = srv.deploy(name, FIX / f"{kind}.pt", {**config, "device": dev})
            if r.status_code != 201:
                report(False, f"deploy {kind} device={dev}", f"{r.status_code} {r.text[:300]}")
                continue
            rows = json.loads((FIX / f"{kind}_input.json").read_text())
            want = np.array(json.loads((FIX / f"{kind}_expected.json").read_text()),
                            dtype=np.float32)
            try:
                d1 = maxdiff(srv.predict(name, rows), want)
                x = rng.standard_normal((64, *config["input"]["shape"]), dtype=np.float32)
                d2 = maxdiff(srv.predict(name, x.tolist()), cpu_ref(refs[kind], x))
            except Exception as e:  # noqa: BLE001 - reported, not raised
                report(False, f"predict {kind} device={dev}", str(e))
                continue
            report(d1 <= TOL and d2 <= TOL, f"predict {kind} device={dev}",
                   f"max abs diff fixtures {d1:.3g}, 64 random rows {d2:.3g} (tol {TOL:g})")
    mib = gpu_mib_of(srv.proc.pid)
    report(mib is not None and mib > 0, "modeld holds GPU memory",
           f"nvidia-smi: {mib} MiB for pid {srv.proc.pid}")


def check_unload_gives_gpu_memory_back(srv, cycles=100):
    """Issue 24: a version unloaded gives its GPU memory back. A second
    version of the CNN on cuda (make_default=false: it loads on demand) is
    loaded, asked, and unloaded `cycles` times; nvidia-smi's memory for the
    process must end within 5 % of its value after the first cycle (the CUDA
    context and kernels are made once)."""
    name = "cnn_unload"
    config = {**CNN_CONFIG, "device": CUDA}
    for default in (True, False):
        with open(FIX / "cnn.pt", "rb") as f:
            r = requests.post(f"{srv.url}/models/{name}/versions", files={"checkpoint": f},
                              data={"config": json.dumps(config),
                                    "make_default": "true" if default else "false"},
                              timeout=120)
        if r.status_code != 201:
            report(False, "unload gives GPU memory back", f"deploy: {r.status_code} {r.text[:300]}")
            return
    rows = json.loads((FIX / "cnn_input.json").read_text())

    def cycle():
        for step in ("load", "unload"):
            r = requests.post(f"{srv.url}/models/{name}/versions/2/{step}", timeout=120)
            if r.status_code != 200:
                raise RuntimeError(f"{step}: {r.status_code} {r.text[:300]}")
            if step == "load":
                r = requests.post(f"{srv.url}/models/{name}/versions/2/predict",
                                  json={"instances": rows}, timeout=60)
                if r.status_code != 200:
                    raise RuntimeError(f"predict: {r.status_code} {r.text[:300]}")

    try:
        cycle()
        base = gpu_mib_of(srv.proc.pid)
        for _ in range(cycles - 1):
            cycle()
        after = gpu_mib_of(srv.proc.pid)
    except Exception as e:  # noqa: BLE001 - reported, not raised
        report(False, "unload gives GPU memory back", str(e))
        return
    ok = base is not None and after is not None and after <= base * 1.05 + 2
    report(ok, "unload gives GPU memory back",
           f"nvidia-smi {base} MiB after the first load/unload, {after} MiB after {cycles}")


def gpu_used_mib():
    """The whole card's used memory (MiB): where nvidia-smi lists no processes
    (a sandboxed driver), the machine runs modeld alone."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True,
                             timeout=20).stdout
        return int(out.split()[0])
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        return None


def check_big_unload(srv, tmp, cycles=5):
    """Issue 24 with weights big enough to see: a 256 MiB MLP (four 4096x4096
    linears) on cuda. Loaded, it must hold at least 80 % of its weights on the
    card; unloaded, the card must be back within 5 % (+16 MiB) of before it
    loaded, every cycle (md_torch_free empties the caching allocator)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(4)]).eval()
    weights_mib = sum(p.numel() * 4 for p in net.parameters()) / 2**20
    path = Path(tmp) / "big.pt"
    torch.jit.script(net).save(str(path))
    name = "big_unload"
    config = {"input": {"shape": [4096]}, "device": CUDA}
    for default in (True, False):
        with open(path, "rb") as f:
            r = requests.post(f"{srv.url}/models/{name}/versions", files={"checkpoint": f},
                              data={"config": json.dumps(config),
                                    "make_default": "true" if default else "false"},
                              timeout=300)
        if r.status_code != 201:
            report(False, "big version unload", f"deploy: {r.status_code} {r.text[:300]}")
            return
    by_pid = gpu_mib_of(srv.proc.pid) is not None
    mib = (lambda: gpu_mib_of(srv.proc.pid)) if by_pid else gpu_used_mib
    x = torch.rand(2, 4096)
    want = cpu_ref(net, x.numpy())
    seen = []
    try:
        for _ in range(cycles):
            base = mib()
            r = requests.post(f"{srv.url}/models/{name}/versions/2/load", timeout=300)
            if r.status_code != 200:
                raise RuntimeError(f"load: {r.status_code} {r.text[:300]}")
            r = requests.post(f"{srv.url}/models/{name}/versions/2/predict",
                              json={"instances": x.tolist()}, timeout=60)
            if r.status_code != 200:
                raise RuntimeError(f"predict: {r.status_code} {r.text[:300]}")
            d = maxdiff(r.json()["predictions"], want)
            loaded = mib()
            r = requests.post(f"{srv.url}/models/{name}/versions/2/unload", timeout=300)
            if r.status_code != 200:
                raise RuntimeError(f"unload: {r.status_code} {r.text[:300]}")
            after = mib()  # the last request's reference may free it a moment later
            deadline = time.monotonic() + 10
            while after is not None and base is not None and after > base * 1.05 + 16 \
                    and time.monotonic() < deadline:
                time.sleep(0.2)
                after = mib()
            seen.append((base, loaded, after, d))
    except Exception as e:  # noqa: BLE001 - reported, not raised
        report(False, "big version unload", str(e))
        return
    ok = all(b is not None and lo - b >= 0.8 * weights_mib and a <= b * 1.05 + 16 and d <= TOL
             for b, lo, a, d in seen)
    report(ok, f"a {weights_mib:.0f} MiB version on cuda loaded and unloaded {cycles} times",
           f"{'per-process' if by_pid else 'whole-card'} MiB before/loaded/after: "
           + "; ".join(f"{b}/{lo}/{a} (diff {d:.2g})" for b, lo, a, d in seen))


def check_concurrent(srv, refs, threads=8, per_thread=100):
    name = "mlp_conc"
    r = srv.deploy(name, FIX / "mlp.pt",
                   {**MLP_CONFIG, "device": CUDA, "workers": 2,
                    "batching": {"max_batch_size": 64, "max_delay_us": 2000}})
    if r.status_code != 201:
        report(False, "deploy mlp for concurrency", f"{r.status_code} {r.text[:300]}")
        return
    worst = [0.0] * threads
    errors = []

    def client(i):
        rng = np.random.default_rng(100 + i)
        s = requests.Session()
        for _ in range(per_thread):
            n = int(rng.integers(1, 65))
            x = rng.standard_normal((n, 4), dtype=np.float32)
            try:
                worst[i] = max(worst[i], maxdiff(srv.predict(name, x.tolist(), s),
                                                 cpu_ref(refs["mlp"], x)))
            except Exception as e:  # noqa: BLE001
                errors.append(str(e))
                return

    t0 = time.monotonic()
    ts = [threading.Thread(target=client, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    dt = time.monotonic() - t0
    report(not errors and max(worst) <= TOL, f"{threads} threads x {per_thread} requests on cuda",
           f"max abs diff {max(worst):.3g}, {threads * per_thread / dt:.0f} req/s"
           + (f"; errors: {errors[:2]}" if errors else ""))
    (st,) = requests.get(f"{srv.url}/models/{name}", timeout=10).json()["loaded"]
    report(st["requests"] == threads * per_thread and st["batches"] < st["requests"],
           "concurrent cuda requests were batched",
           f"{st['requests']} requests, {st['rows']} rows in {st['batches']} batches "
           f"(mean {st['rows'] / max(st['batches'], 1):.1f} rows/batch)")


def check_errors(srv):
    """A forward that fails on the GPU is a clean 422, and the server goes on."""
    r = srv.deploy("mlp_bad", FIX / "mlp.pt", {"input": {"shape": [5]}, "device": CUDA})
    body = r.json() if r.headers.get("Content-Type", "").startswith("application/json") else {}
    code = body.get("error", {}).get("code")
    msg = body.get("error", {}).get("message", "")
    report(r.status_code == 422 and code == "model_test_failed" and "\n" not in msg,
           "cuda forward on a wrong shape is a 422", f"{r.status_code} {code}: {msg[:200]}")
    rows = json.loads((FIX / "mlp_input.json").read_text())
    want = np.array(json.loads((FIX / "mlp_expected.json").read_text()), dtype=np.float32)
    d = maxdiff(srv.predict("mlp_cuda", rows), want)
    report(d <= TOL, "cuda model still right after the failed forward", f"max abs diff {d:.3g}")


def online_latency(srv, name, seconds, threads=4, stop=None):
    """1-row JSON requests from `threads` threads for `seconds` or until the event
    `stop` is set: (count, p50 ms, p99 ms, error statuses)."""
    row = [float(v) for v in np.random.default_rng(3).integers(0, 256, 784)]
    lat = []
    errors = []

    def client():
        s = requests.Session()
        end = time.monotonic() + seconds
        while time.monotonic() < end and not (stop and stop.is_set()):
            t = time.monotonic()
            r = s.post(f"{srv.url}/models/{name}/predict", json={"instances": [row]}, timeout=30)
            lat.append(time.monotonic() - t)
            if r.status_code != 200:
                errors.append(r.status_code)

    ts = [threading.Thread(target=client) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    a = np.array(lat) * 1000
    return len(a), float(np.percentile(a, 50)), float(np.percentile(a, 99)), errors


def check_job_beside_online(srv, tmp):
    """A long job on the GPU beside online 1-row requests to the same cuda model:
    both finish, and the online latency is reported beside the idle one."""
    n = int(os.environ.get("MIXED_ROWS", "3000000"))
    path = Path(tmp) / "big_u8.npy"
    np.save(path, np.random.default_rng(4).integers(0, 256, (n, 784), dtype=np.uint8))
    idle = online_latency(srv, "fashion_cuda", 3)
    r = requests.post(f"{srv.url}/jobs", json={"model": "fashion_cuda", "input": {
        "path": str(path), "format": "npy"}, "output": {"format": "npy"}}, timeout=30)
    if r.status_code != 202:
        report(False, "job beside online load", f"POST /jobs {r.status_code} {r.text[:200]}")
        return
    jid = r.json()["id"]
    t0 = time.monotonic()
    done = threading.Event()
    res = {}

    def waiter():
        res["job"] = wait_job(srv, jid)
        res["dt"] = time.monotonic() - t0
        done.set()

    w = threading.Thread(target=waiter)
    w.start()
    busy = online_latency(srv, "fashion_cuda", 60, stop=done)
    w.join()
    job, dt = res["job"], res["dt"]
    report(job["status"] == "succeeded" and job["rows_done"] == n and not idle[3] and not busy[3],
           f"{n}-row cuda job beside 1-row online requests (4 threads)",
           f"job {job['status']} in {dt:.1f} s ({n / dt:.0f} rows/s); online alone: {idle[0]} req, "
           f"p50 {idle[1]:.2f} ms p99 {idle[2]:.2f} ms; during the job ({dt:.1f} s): {busy[0]} req, "
           f"p50 {busy[1]:.2f} ms p99 {busy[2]:.2f} ms")


def wait_job(srv, jid, timeout=300):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = requests.get(f"{srv.url}/jobs/{jid}", timeout=10).json()
        if job.get("status") in ("succeeded", "failed", "cancelled"):
            return job
        time.sleep(0.05)
    return {"status": "timeout"}


def run_job(srv, spec):
    r = requests.post(f"{srv.url}/jobs", json=spec, timeout=30)
    if r.status_code != 202:
        return None, f"POST /jobs: {r.status_code} {r.text[:300]}", None
    jid = r.json()["id"]
    t0 = time.monotonic()
    job = wait_job(srv, jid)
    dt = time.monotonic() - t0
    if job["status"] != "succeeded":
        return job, f"job {job.get('status')}: {json.dumps(job)[:400]}", dt
    out = requests.get(f"{srv.url}/jobs/{jid}/output", timeout=60)
    return job, out, dt


def check_jobs(srv, refs):
    # mlp on cuda over the SMALL table, NPY in and out
    path = FIX / "datasets" / "small_f32.npy"
    job, out, _ = run_job(srv, {"model": "mlp_cuda", "input": {"path": str(path),
                                                                "format": "npy"},
                                "output": {"format": "npy"}})
    if isinstance(out, str) or out is None:
        report(False, "job mlp cuda over small_f32.npy", str(out))
    else:
        got = np.load(io.BytesIO(out.content))
        d = maxdiff(got, cpu_ref(refs["mlp"], np.load(path)))
        report(d <= TOL and job["rows_done"] == 6, "job mlp cuda over small_f32.npy",
               f"{job['rows_done']} rows, max abs diff {d:.3g}")

    images = FMNIST_DIR / "t10k-images-idx3-ubyte.gz"
    labels = FMNIST_DIR / "t10k-labels-idx1-ubyte.gz"
    if not images.exists():
        print(f"SKIP FashionMNIST job: no {images}", flush=True)
        return
    for dev in ("cuda", "cpu"):
        name = f"fashion_{dev}"
        r = srv.deploy(name, EXAMPLE / "model.pt",
                       {**FASHION_CONFIG, "device": CUDA if dev == "cuda" else dev})
        if r.status_code != 201:
            report(False, f"deploy fashion device={dev}", f"{r.status_code} {r.text[:300]}")
            continue
        spec = {"model": name, "input": {"path": str(images), "format": "idx",
                                         "label": str(labels)}}
        job, out, dt = run_job(srv, spec)
        ok = not isinstance(out, str) and job["correct"] == 8675 and job["labeled"] == 10000
        report(ok, f"job fashion {dev} over t10k IDX.gz",
               f"correct {job.get('correct') if job else None}/10000 (PyTorch: 8675), "
               f"{10000 / dt:.0f} rows/s wall" if dt else str(out))
        if dev != "cuda":
            continue
        job, out, dt = run_job(srv, {**spec, "output": {"format": "npy"}})
        if isinstance(out, str) or out is None:
            report(False, "job fashion cuda NPY logits", str(out))
            continue
        got = np.load(io.BytesIO(out.content))
        import gzip
        raw = np.frombuffer(gzip.open(images).read(), dtype=np.uint8, offset=16)
        x = raw.reshape(-1, 784).astype(np.float32) * np.float32(FASHION_CONFIG["preprocess"]["scale"])
        d = maxdiff(got, cpu_ref(refs["fashion"], x))
        report(d <= TOL, "job fashion cuda NPY logits vs CPU torch", f"max abs diff {d:.3g}")


def off_thread_decodes(srv):
    for line in requests.get(f"{srv.url}/metrics", timeout=10).text.splitlines():
        if line.startswith("modeld_http_decoded_off_thread_total"):
            return float(line.split()[-1])
    return None


def check_protocols(srv, refs):
    """The bodies real clients send, answered by the FashionMNIST model on cuda:
    full-precision JSON floats as json.dumps(x.tolist()) writes them (64 rows,
    past 64 KiB, so decoded on the pool), NPY in and out, the Open Inference
    Protocol's binary tensor data extension (FP32 and FP16 in, binary out, as
    tritonclient.http sends them) and the KServe V1 data plane."""
    name = "fashion_cuda"
    scale = np.float32(FASHION_CONFIG["preprocess"]["scale"])
    x = (np.random.default_rng(5).random((64, 784), dtype=np.float32) * 255).astype(np.float32)
    want = cpu_ref(refs["fashion"], x * scale)
    url = f"{srv.url}/models/{name}/predict"
    try:
        before = off_thread_decodes(srv)
        body = json.dumps({"instances": x.tolist()})
        r = requests.post(url, data=body, headers={"Content-Type": "application/json"}, timeout=60)
        after = off_thread_decodes(srv)
        got = np.array(r.json()["predictions"], np.float32) if r.status_code == 200 else None
        d = maxdiff(got, want) if got is not None else float("inf")
        report(d <= TOL and before is not None and after == before + 1,
               "64 full-precision JSON rows on cuda, decoded off the HTTP thread",
               f"{r.status_code}, {len(body)} bytes, max abs diff {d:.3g}, "
               f"decoded_off_thread {before} -> {after}")

        buf = io.BytesIO()
        np.save(buf, x)
        r = requests.post(url, data=buf.getvalue(), timeout=60,
                          headers={"Content-Type": "application/x-npy",
                                   "Accept": "application/x-npy"})
        ok = r.status_code == 200 and r.headers.get("Content-Type", "").startswith(
            "application/x-npy")
        d = maxdiff(np.load(io.BytesIO(r.content)), want) if ok else float("inf")
        report(ok and d <= TOL, "64 NPY rows in, NPY out on cuda",
               f"{r.status_code} {r.headers.get('Content-Type')}, max abs diff {d:.3g}")

        for dtype, typed in (("FP32", x), ("FP16", x.astype(np.float16))):
            raw = typed.tobytes()
            head = json.dumps({"id": "g1", "inputs": [{
                "name": "input0", "shape": list(typed.shape), "datatype": dtype,
                "parameters": {"binary_data_size": len(raw)}}],
                "outputs": [{"name": "logits", "parameters": {"binary_data": True}}]}).encode()
            r = requests.post(f"{srv.url}/v2/models/{name}/infer", data=head + raw, timeout=60,
                              headers={"Content-Type": "application/octet-stream",
                                       "Inference-Header-Content-Length": str(len(head))})
            d, detail = float("inf"), f"{r.status_code} {r.text[:200] if r.status_code != 200 else ''}"
            if r.status_code == 200 and "Inference-Header-Content-Length" in r.headers:
                n = int(r.headers["Inference-Header-Content-Length"])
                out = json.loads(r.content[:n])["outputs"][0]
                vals = np.frombuffer(r.content[n:], dtype="<f4").reshape(out["shape"])
                ref = cpu_ref(refs["fashion"], typed.astype(np.float32) * scale)
                d = maxdiff(vals, ref)
                detail = f"{out['datatype']} {out['shape']}, max abs diff {d:.3g}"
            report(d <= TOL, f"V2 binary tensor data {dtype} in, binary out on cuda", detail)

        r = requests.post(f"{srv.url}/v1/models/{name}:predict", json={"instances": x[:3].tolist()},
                          timeout=60)
        got = np.array(r.json()["predictions"], np.float32) if r.status_code == 200 else None
        d = maxdiff(got, want[:3]) if got is not None else float("inf")
        ready = requests.get(f"{srv.url}/v1/models/{name}", timeout=10)
        report(d <= TOL and ready.status_code == 200, "KServe V1 :predict and readiness on cuda",
               f"{r.status_code}, max abs diff {d:.3g}; GET /v1/models/{name} {ready.status_code} "
               f"{ready.text[:120]}")
    except (requests.RequestException, ValueError, KeyError) as e:
        report(False, "protocol checks on cuda", repr(e))


def bench_client(url, body, seconds, q):
    s = requests.Session()
    lat = []
    hdr = {"Content-Type": "application/x-npy"}
    end = time.monotonic() + seconds
    n = 0
    errors = 0
    while time.monotonic() < end:
        t = time.monotonic()
        r = s.post(url, data=body, headers=hdr, timeout=30)
        lat.append(time.monotonic() - t)
        if r.status_code == 200:
            n += 1
        else:
            errors += 1
    q.put((n, errors, lat))


def bench(srv):
    rng = np.random.default_rng(1)
    x = rng.integers(0, 256, (64, 784)).astype(np.float32)
    buf = io.BytesIO()
    np.save(buf, x)
    body = buf.getvalue()
    rows = []
    for dev in ("cuda", "cpu"):
        url = f"{srv.url}/models/fashion_{dev}/predict"
        if requests.post(url, data=body, headers={"Content-Type": "application/x-npy"},
                         timeout=30).status_code != 200:
            print(f"SKIP throughput {dev}: model fashion_{dev} does not answer", flush=True)
            continue
        q = mp.Queue()
        ps = [mp.Process(target=bench_client, args=(url, body, BENCH_SECONDS, q))
              for _ in range(BENCH_CLIENTS)]
        for p in ps:
            p.start()
        res = [q.get() for _ in ps]
        for p in ps:
            p.join()
        n = sum(r[0] for r in res)
        errs = sum(r[1] for r in res)
        lat = np.sort(np.concatenate([np.array(r[2]) for r in res])) * 1000
        rows.append((dev, n / BENCH_SECONDS, 64 * n / BENCH_SECONDS, np.percentile(lat, 50),
                     np.percentile(lat, 99), errs))
    print(f"\nthroughput: FashionMNIST MLP, 64-row NPY requests, {BENCH_CLIENTS} client "
          f"processes, {BENCH_SECONDS:g} s each, default workers and batching")
    print(f"{'device':6} {'req/s':>8} {'rows/s':>9} {'p50 ms':>7} {'p99 ms':>7} {'errors':>6}")
    for dev, rps, rowps, p50, p99, errs in rows:
        print(f"{dev:6} {rps:8.0f} {rowps:9.0f} {p50:7.2f} {p99:7.2f} {errs:6d}")


def main():
    print(f"torch {torch.__version__}, cuda available {torch.cuda.is_available()}, "
          f"{torch.cuda.get_device_name(0) if torch.cuda.is_available() else '-'}", flush=True)
    torch.set_num_threads(4)
    refs = {"mlp": torch.jit.load(str(FIX / "mlp.pt"), map_location="cpu").eval(),
            "cnn": torch.jit.load(str(FIX / "cnn.pt"), map_location="cpu").eval(),
            "fashion": torch.jit.load(str(EXAMPLE / "model.pt"), map_location="cpu").eval()}
    with tempfile.TemporaryDirectory() as tmp:
        srv = Modeld(tmp)
        err = srv.wait_ready()
        report(err is None, "modeld starts, /healthz and /readyz 200", err or "")
        if err:
            return 1
        try:
            check_models(srv, refs)
            check_concurrent(srv, refs)
            check_unload_gives_gpu_memory_back(srv)
            check_big_unload(srv, tmp)
            check_errors(srv)
            check_jobs(srv, refs)
            check_protocols(srv, refs)
            if os.environ.get("GPU_CHECK_MIXED", "1") == "1" and \
                    (FMNIST_DIR / "t10k-images-idx3-ubyte.gz").exists():
                check_job_beside_online(srv, tmp)
            if BENCH_SECONDS > 0:
                bench(srv)
        finally:
            if srv.proc.poll() is not None:
                report(False, "modeld still running at the end",
                       f"exit {srv.proc.returncode}: {srv.stderr()}")
            srv.stop()
            tail = srv.stderr()
            if "ERROR" in tail or "error" in tail:
                print("modeld stderr (tail):\n" + tail)
    print(f"\n{'ALL PASS' if not failures else 'FAILED: ' + ', '.join(failures)}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
