"""
test_memory_limit.py - the real binary in a memory-limited container (issue
24): a memory cgroup of 1 GiB, as `docker run -m 1g` or a Kubernetes limit
makes one, and the hostile requests that each once pushed the process past
4 GiB, plus 10 deploys of a 192 MB model (ten models, each a default, so
max_loaded_bytes must unload defaults too and load them again on demand).

What must hold, as an operator would check it:
- the process is never killed (the cgroup's OOM killer never ran, the
  server answers at the end);
- every answer is a 2xx, a 4xx or a 503 (with Retry-After), never a reset
  or a 500;
- /healthz answers throughout (every probe 200, each under 100 ms, measured
  from a process of its own: a probe that waits on memory reclaim or a
  blocked thread would show there).

cgroup v1 (these machines: /sys/fs/cgroup/memory, writable as root) or v2
(memory.max); skipped, saying why, where neither is writable. `make faults`
runs it with the other fault tests; it is part of `make test` too.
"""
import io
import json
import os
import statistics
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest
import requests

from conftest import REPO, SANITIZED, TSCALE
import test_hardening_memory as hm

# 1 GiB as a container's limit. Under ASan (make asan) the same process
# holds more: shadow memory, and freed blocks kept in its 256 MB quarantine;
# at 1 GiB it ran at the limit in constant reclaim (peak 1024 MiB, failcnt
# 220k), and in one CI run the server was gone mid-test (the likely cause the
# OOM killer; its stderr was not kept then: it is now). 2 GiB there: every
# hostile request below still reached 4-5 GB before its fix.
LIMIT = (2 << 30) if SANITIZED else (1 << 30)
BUDGET = 512 << 20  # max_loaded_bytes: two of the 192 MB models
V1 = Path("/sys/fs/cgroup/memory")
V2 = Path("/sys/fs/cgroup")

# the 192 MB TorchScript MLP of issue 24, as bench/memory.py makes it
sys.path.insert(0, str(REPO / "bench"))
from memory import MAKE_BIG  # noqa: E402


class Cgroup:
    """A memory cgroup of its own, v1 or v2, removed at the end."""

    def __init__(self, limit):
        name = f"modeld-test-{os.getpid()}-{time.monotonic_ns()}"
        if (V1 / "cgroup.procs").exists() and os.access(V1, os.W_OK):
            self.v2 = False
            self.path = V1 / name
            self.path.mkdir()
            (self.path / "memory.limit_in_bytes").write_text(str(limit))
        elif (V2 / "cgroup.controllers").exists() and "memory" in \
                (V2 / "cgroup.controllers").read_text() and os.access(V2, os.W_OK):
            self.v2 = True
            self.path = V2 / name
            self.path.mkdir()
            (self.path / "memory.max").write_text(str(limit))
            (self.path / "memory.swap.max").write_text("0") if \
                (self.path / "memory.swap.max").exists() else None
        else:
            pytest.skip("no writable memory cgroup (cgroup v1 /sys/fs/cgroup/memory or v2 "
                        "memory.max): run as root on a host that delegates one")

    def wrap(self, argv):
        """`argv` run inside the cgroup from its first instruction, as a
        container's process is (its pid joins cgroup.procs, then execs)."""
        return ["/bin/sh", "-c", f'echo $$ > "{self.path / "cgroup.procs"}" && exec "$@"', "sh",
                *argv]

    def oom_kills(self):
        if self.v2:
            for line in (self.path / "memory.events").read_text().splitlines():
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
            return 0
        for line in (self.path / "memory.oom_control").read_text().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
        return 0

    def failcnt(self):
        f = self.path / ("memory.events" if self.v2 else "memory.failcnt")
        if self.v2:
            for line in f.read_text().splitlines():
                if line.startswith("max "):
                    return int(line.split()[1])
            return 0
        return int(f.read_text())

    def peak(self):
        f = self.path / ("memory.peak" if self.v2 else "memory.max_usage_in_bytes")
        return int(f.read_text()) if f.exists() else -1

    def remove(self):
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


@pytest.fixture(scope="module")
def big_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("big") / "mlp4096.pt"
    subprocess.run(["/usr/bin/python3", "-c", MAKE_BIG, str(path)], check=True, timeout=600)
    return path


@pytest.fixture
def cgroup():
    cg = Cgroup(LIMIT)
    yield cg
    cg.remove()


def png_with_ztxt(chunks=400, each=10 << 20):
    """A 28x28 grayscale PNG with `chunks` zTXt chunks, each inflating to
    `each` bytes of zeros (a few KB deflated): 4 GB for libpng to keep."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + \
            struct.pack(">I", zlib.crc32(kind + data) & 0xffffffff)
    ihdr = struct.pack(">IIBBBBB", 28, 28, 8, 0, 0, 0, 0)
    idat = zlib.compress(b"".join(b"\0" + bytes(28) for _ in range(28)))
    z = b"k\0\0" + zlib.compress(bytes(each), 9)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"zTXt", z) * chunks + \
        chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def v2_with_junk(mb=30):
    """A V2 request whose data is one row and whose parameters hold `mb` MB of
    `{},`: a tree of tens of millions of empty objects if parsed whole."""
    n = (mb << 20) // 3
    head = json.dumps({"inputs": [{"name": "x", "shape": [1, 4096], "datatype": "FP32",
                                   "data": [0.5] * 4096}]})[:-1]
    return (head + ', "parameters": {"junk": [' + "{}," * (n - 1) + "{}]}}").encode()


# /healthz every 20 ms until a line on stdin; one JSON line [seconds, status]
# per probe (a status, or the exception's repr)
PROBER = r"""
import json, sys, threading, time, urllib.request
url = sys.argv[1] + "/healthz"
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
while not stop.is_set():
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            r.read()
            st = r.status
    except Exception as e:
        st = repr(e)
    print(json.dumps([time.monotonic() - t0, st]), flush=True)
    stop.wait(0.02)
"""


def test_a_memory_limited_server_is_never_killed(start_server, cgroup, big_model, tmp_path):
    srv = start_server("--max-loaded-bytes", str(BUDGET), "--workers", "2", wait=False)
    srv.argv = cgroup.wrap(srv.argv)
    srv.start()
    assert str(srv.proc.pid) in (cgroup.path / "cgroup.procs").read_text().split()
    answers = []
    # the prober is a process of its own: in this one, building a 60 MB body
    # holds the GIL and its time would be counted as the server's
    prober = subprocess.Popen([sys.executable, "-c", PROBER, srv.url],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def record(what, fn):
        try:
            r = fn()
            answers.append((what, r.status_code, r.headers.get("Retry-After"), r.text[:200]))
            return r
        except requests.RequestException as e:
            answers.append((what, repr(e), None, ""))
            return None

    try:
        # a small version that takes images, for the PNG below
        with open(REPO / "examples" / "fashion_mnist" / "model.pt", "rb") as f:
            record("deploy img", lambda: requests.post(
                srv.url + "/models/img/versions", files={"checkpoint": f},
                data={"config": (REPO / "examples" / "fashion_mnist" /
                                 "model_image.json").read_text()}, timeout=60 * TSCALE))
        cfg = json.dumps({"input": {"shape": [4096]}})
        for i in range(10):
            def deploy(i=i):
                with open(big_model, "rb") as f:
                    return requests.post(srv.url + f"/models/m{i}/versions",
                                         files={"checkpoint": f}, data={"config": cfg},
                                         timeout=300 * TSCALE)
            record(f"deploy m{i}", deploy)
            # an earlier default, unloaded by the budget, loads again on demand
            record(f"predict m{i // 2}", lambda i=i: requests.post(
                srv.url + f"/models/m{i // 2}/predict", json=[[0.5] * 4096],
                timeout=300 * TSCALE))
        # (recorded, not asserted here: a server gone is reported below with its stderr)
        record("architecture", lambda: srv.request(
            "PUT", "/models/m/architecture", data=(hm.CK / "mlp_arch.pt").read_bytes(),
            headers={"Content-Type": "application/octet-stream"}, timeout=60 * TSCALE))
        bomb = hm.deflate_bomb()
        hostile = [
            ("zip directories", lambda: hm.upload(srv, hm.torch_save_two_directories(bomb))),
            ("zip64 bomb", lambda: hm.upload(srv, hm.torch_save_zip64_bomb(bomb))),
            ("torchscript bomb", lambda: hm.upload(srv, hm.torchscript_version_bomb(bomb))),
            ("expanded view", lambda: hm.upload(
                srv, hm.saved({"fc1.weight": hm.torch.zeros(1).expand(2 ** 30)}))),
            ("ztxt png", lambda: requests.put(srv.url + "/models/img/predict",
                                              data=png_with_ztxt(), timeout=300 * TSCALE,
                                              headers={"Content-Type": "image/png"})),
            ("v2 junk", lambda: requests.post(srv.url + "/v2/models/m9/infer",
                                              data=v2_with_junk(), timeout=300 * TSCALE)),
        ]
        for what, fn in hostile:
            record(what, fn)
        record("predict m9", lambda: requests.post(srv.url + "/models/m9/predict",
                                                   json=[[0.5] * 4096], timeout=300 * TSCALE))
    finally:
        out, _ = prober.communicate("stop\n", timeout=60)
    probes = [json.loads(line) for line in out.splitlines()]
    alive = srv.proc.poll() is None
    kills = cgroup.oom_kills()
    summary = "\n".join(f"  {a}" for a in answers)
    lat = sorted(p[0] for p in probes)
    print(f"cgroup peak {cgroup.peak() >> 20} MiB of {LIMIT >> 20}, failcnt {cgroup.failcnt()}, "
          f"healthz median {statistics.median(lat) * 1e3:.1f} ms, max {lat[-1] * 1e3:.1f} ms "
          f"over {len(lat)} probes\n{summary}")
    assert alive and kills == 0, \
        f"the server was killed (oom_kill {kills}); stderr:\n{srv.stderr[-3000:]}\n{summary}"
    bad = [a for a in answers if not (isinstance(a[1], int) and
                                      (200 <= a[1] < 500 or a[1] == 503))]
    assert not bad, f"answers neither 2xx, 4xx nor 503: {bad}\n{summary}"
    assert all(a[2] for a in answers if a[1] == 503), f"a 503 without Retry-After:\n{summary}"
    assert all(a[1] < 300 for a in answers if a[0].startswith("deploy") or
               a[0] == "architecture"), summary
    for what in ("zip directories", "zip64 bomb", "torchscript bomb", "expanded view",
                 "ztxt png", "v2 junk"):
        st = next(a[1] for a in answers if a[0] == what)
        assert 400 <= st < 500 or st == 200, f"{what}: {st}\n{summary}"
    failed = [p for p in probes if p[1] != 200]
    assert not failed, f"/healthz failed: {failed[:5]}"
    # measured 0.7 ms median, 5-6 ms at worst on a 2-core machine (the
    # slowest 18-125 ms seen before were this test's own GIL, when the
    # prober was a thread beside the code building 60 MB bodies)
    assert statistics.median(lat) < 0.1 and lat[-1] < 0.1 * TSCALE, \
        f"/healthz median {statistics.median(lat):.3f} s, max {lat[-1]:.3f} s"
    r = requests.get(srv.url + "/healthz", timeout=10)
    assert r.status_code == 200
