"""
test_nginx.py - modeld behind a real nginx (Debian's), the topology of
docker/compose.yaml: two replicas sharing one store, nginx in front, run with
docker/nginx.conf itself (only the upstream addresses, the listen address,
the log and temporary paths are swapped for loopback and tmp ones).

The rolling restart: predictions go through nginx at a steady, bounded rate
(a few client threads with fixed pacing) while replica 1 gets SIGTERM, exits,
is started again on the same port and store (and has served traffic through
nginx again), then replica 2 the same. Every request must succeed with the
committed fixture's answer. The test waits on events (exit codes, /readyz,
requests seen in a replica's access log), never on the machine's speed.

nginx runs as a plain subprocess (`nginx -c CONF -p PREFIX -g 'daemon off;
...'`), no system service; `make deps` installs the Debian package.
"""
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import requests

from conftest import REPO, TSCALE, Server, free_port

FIXTURES = REPO / "tests" / "fixtures"
MLP_PT = FIXTURES / "mlp.pt"
MLP_IN = json.loads((FIXTURES / "mlp_input.json").read_text())
MLP_OUT = np.array(json.loads((FIXTURES / "mlp_expected.json").read_text()), dtype=np.float64)
NGINX_CONF = REPO / "docker" / "nginx.conf"
DRAIN_SECONDS = 3     # longer than the upstream's fail_timeout (2 s) in docker/nginx.conf
CLIENTS = 4
INTERVAL_S = 0.02     # per client: at most 50 requests/s each, 200/s in all
GIVEN_TP = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def nginx_bin():
    path = shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)
    if not path:
        pytest.fail("nginx not found: `make deps` installs Debian's nginx package")
    return path


def sub_once(text, old, new):
    """Replace `old`, which must occur exactly once: if docker/nginx.conf
    changes shape, this test must be updated rather than test something else."""
    assert text.count(old) == 1, f"docker/nginx.conf: expected {old!r} exactly once"
    return text.replace(old, new)


def loopback_conf(tmp, nginx_port, *ports):
    """docker/nginx.conf on loopback: its two upstream servers become one line
    per replica port in `ports` (two or more), each with the first's parameters."""
    text = NGINX_CONF.read_text()
    first = re.search(r"^(\s*)server modeld-1:8080 (.*)\n", text, re.M)
    second = re.search(r"^\s*server modeld-2:8080 .*\n", text, re.M)
    assert first and second, "docker/nginx.conf: expected upstreams modeld-1:8080 and modeld-2:8080"
    lines = "".join(f"{first.group(1)}server 127.0.0.1:{p} {first.group(2)}\n" for p in ports)
    text = sub_once(text, second.group(0), "")
    text = sub_once(text, first.group(0), lines)
    text = sub_once(text, "listen 8080;", f"listen 127.0.0.1:{nginx_port};")
    text = sub_once(text, "access_log /dev/stdout modeld;", f"access_log {tmp}/nginx-access.log modeld;")
    text = sub_once(text, "worker_processes auto;", "worker_processes 1;")
    temp = "".join(f"    {d}_temp_path {tmp}/{d}_temp;\n"
                   for d in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    text = sub_once(text, "http {\n", "http {\n" + temp)
    if os.geteuid() == 0:
        # as root nginx's workers would run as nobody, who cannot enter pytest's tmp
        text = "user root;\n" + text
    return text


class Nginx:
    """nginx with docker/nginx.conf in front of the replicas on `ports` (loopback)."""

    def __init__(self, tmp, *ports):
        self.tmp = Path(tmp)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.conf = self.tmp / "nginx.conf"
        self.conf.write_text(loopback_conf(self.tmp, self.port, *ports))
        self.error_log = self.tmp / "nginx-error.log"
        self.access_log = self.tmp / "nginx-access.log"
        self.proc = None

    def start(self, timeout=20.0):
        argv = [nginx_bin(), "-c", str(self.conf), "-p", str(self.tmp),
                "-g", f"daemon off; pid {self.tmp}/nginx.pid; error_log {self.error_log} info;"]
        check = subprocess.run(argv + ["-t"], capture_output=True, text=True, timeout=30)
        assert check.returncode == 0, f"nginx -t: {check.stderr}"
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=open(self.tmp / "nginx-stderr.log", "wb"))
        deadline = time.monotonic() + timeout * TSCALE
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"nginx exited: {self.errors()}"
            try:
                if requests.get(self.url + "/healthz", timeout=2).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            time.sleep(0.05)
        pytest.fail(f"nginx did not answer /healthz within {timeout * TSCALE:.0f} s: {self.errors()}")

    def errors(self):
        return self.error_log.read_text(errors="replace") if self.error_log.exists() else ""

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGQUIT)  # graceful
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def predictions_served(server):
    """Predict requests in `server`'s access log (its own file)."""
    try:
        text = server.access_log.read_text()
    except FileNotFoundError:
        return 0
    return sum(1 for line in text.splitlines() if '"/models/mlp/predict"' in line)


def wait_for(what, cond, timeout):
    deadline = time.monotonic() + timeout * TSCALE
    while not cond():
        assert time.monotonic() < deadline, f"timed out after {timeout * TSCALE:.0f} s: {what}"
        time.sleep(0.05)


class Load:
    """CLIENTS threads, each with its own keep-alive session to nginx, sending
    one prediction every INTERVAL_S (no catch-up bursts) and checking it."""

    def __init__(self, url):
        self.url = url + "/models/mlp/predict"
        self.body = json.dumps(MLP_IN)
        self.stop_event = threading.Event()
        self.lock = threading.Lock()
        self.ok = 0
        self.failures = []
        self.done_times = []
        self.threads = [threading.Thread(target=self.client, daemon=True) for _ in range(CLIENTS)]

    def client(self):
        session = requests.Session()
        next_at = time.monotonic()
        while not self.stop_event.is_set():
            delay = next_at - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            next_at = max(next_at + INTERVAL_S, time.monotonic())
            try:
                r = session.post(self.url, data=self.body, timeout=30 * TSCALE,
                                 headers={"Content-Type": "application/json"})
                err = None
                if r.status_code != 200:
                    err = f"HTTP {r.status_code}: {r.text[:300]!r}"
                else:
                    got = np.array(r.json()["predictions"], dtype=np.float64)
                    if got.shape != MLP_OUT.shape or not np.allclose(got, MLP_OUT, rtol=0, atol=1e-5):
                        err = f"wrong predictions: {r.text[:300]!r}"
            except (requests.RequestException, ValueError, KeyError) as e:
                err = repr(e)
            with self.lock:
                if err:
                    self.failures.append(err)
                else:
                    self.ok += 1
                    self.done_times.append(time.monotonic())
        session.close()

    def start(self):
        for t in self.threads:
            t.start()
        return self

    def finish(self):
        self.stop_event.set()
        for t in self.threads:
            t.join(60 * TSCALE)
        assert not any(t.is_alive() for t in self.threads), "a client thread is stuck"

    def ok_between(self, t0, t1):
        with self.lock:
            return sum(1 for t in self.done_times if t0 <= t <= t1)


@pytest.fixture
def cluster(tmp_path):
    store = tmp_path / "store"
    ports = [free_port(), free_port()]
    started = []

    def replica(i, tag):
        s = Server(tmp_path, store=store, port=ports[i], drain_seconds=DRAIN_SECONDS,
                   access_log=tmp_path / f"access-{i + 1}{tag}.log")
        started.append(s)
        return s.start(timeout=30)

    nginx = Nginx(tmp_path, *ports)
    try:
        yield replica, nginx
    finally:
        nginx.stop()
        for s in started:
            s.finish()


def test_rolling_restart_through_nginx(cluster):
    replica, nginx = cluster
    replicas = [replica(0, "a"), replica(1, "a")]
    nginx.start()

    # deploy through nginx; the other replica picks it up from the shared store
    with open(MLP_PT, "rb") as f:
        r = requests.post(nginx.url + "/models/mlp/versions", files={"checkpoint": f},
                          data={"config": json.dumps({"input": {"shape": [4]}})},
                          timeout=60 * TSCALE)
    assert r.status_code == 201, r.text
    for s in replicas:
        wait_for(f"replica on {s.port} serves mlp",
                 lambda s=s: s.request("POST", "/models/mlp/predict", json=MLP_IN).status_code == 200,
                 30)

    # trace context through nginx: the client's reaches the replica and comes back
    r = requests.post(nginx.url + "/models/mlp/predict", json=MLP_IN,
                      headers={"traceparent": GIVEN_TP}, timeout=30 * TSCALE)
    assert r.status_code == 200 and r.headers.get("traceparent") == GIVEN_TP
    wait_for("the replica logs the client's traceparent",
             lambda: any(GIVEN_TP in s.access_log.read_text() for s in replicas), 10)
    wait_for("nginx logs the traceparent",
             lambda: nginx.access_log.exists() and GIVEN_TP in nginx.access_log.read_text(), 10)

    load = Load(nginx.url).start()
    try:
        for i in range(2):
            old = replicas[i]
            wait_for(f"replica {i + 1} serves traffic through nginx",
                     lambda: predictions_served(old) >= 20, 60)
            t_stop = time.monotonic()
            rc = old.stop(signal.SIGTERM, timeout=DRAIN_SECONDS + 30)
            assert rc == 0, f"replica {i + 1} exited {rc} on SIGTERM; stderr:\n{old.stderr}"
            new = replica(i, "b")              # waits for /readyz
            t_up = time.monotonic()
            replicas[i] = new
            assert load.ok_between(t_stop, t_up) > 0, "no request completed during the restart"
            # nginx put the restarted replica back in rotation before the next one stops
            wait_for(f"restarted replica {i + 1} serves traffic through nginx",
                     lambda: predictions_served(new) >= 20, 60)
    finally:
        load.finish()

    assert not load.failures, (f"{len(load.failures)} failed of {load.ok + len(load.failures)}; "
                               f"first: {load.failures[:5]}\nnginx errors:\n{nginx.errors()[-3000:]}")
    assert load.ok > 0
    # every prediction passed through nginx and was logged by it
    logged = nginx.access_log.read_text()
    assert len(re.findall(r'"POST /models/mlp/predict HTTP/1.1" 200', logged)) >= load.ok
