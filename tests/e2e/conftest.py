"""
conftest.py - start the real modeld binary for end-to-end tests.

`Server` runs the binary (MODELD_BIN, default <repo>/modeld) on a free
loopback port with a private store and access log under the test's tmp_path,
waits until GET /healthz answers, and is always killed at teardown.

Fixtures:
  server        a Server with the default arguments, already started
  shared_server one such Server for the whole session (read-only tests only)
  start_server  factory: start_server("--max-body-bytes", "1000", env={...});
                waits for /healthz and then /readyz (ready=False: /healthz only)
  run_modeld    run the binary to completion (config errors, --help, ...)
  tscale        timeout multiplier: 3 when ASAN_E2E=1, 5 when TSAN_E2E=1, else 1
  s3            a real S3 server (s3rver behind a SigV4-checking proxy: s3.py)

Under a sanitizer build (ASAN_E2E=1 or TSAN_E2E=1) every server is stopped with
SIGTERM at teardown, so LeakSanitizer runs, and a test fails when the server's
stderr holds a sanitizer report.

Raw-socket helpers (import with `from conftest import ...`): free_port,
raw_connect, read_http_response.

PostgreSQL (pg.py, for the index in PostgreSQL): pg_cluster (a throwaway
cluster for the session) and pg_url (a fresh database in it per test).
"""
import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import requests

from pg import pg_cluster, pg_url  # noqa: F401  (fixtures)

REPO = Path(__file__).resolve().parents[2]
SANITIZED = os.environ.get("ASAN_E2E") == "1" or os.environ.get("TSAN_E2E") == "1"
TSCALE = (5.0 if os.environ.get("TSAN_E2E") == "1" else 3.0) if SANITIZED else 1.0
# What a sanitizer prints when it finds something (ASan, LSan, UBSan, TSan).
SANITIZER_REPORT = ("ERROR: AddressSanitizer", "ERROR: LeakSanitizer", "runtime error:",
                    "WARNING: ThreadSanitizer")


def modeld_bin():
    path = os.environ.get("MODELD_BIN") or str(REPO / "modeld")
    if not os.path.isfile(path) or not os.access(path, os.X_OK):
        pytest.fail(f"modeld binary not found at {path}; run `make` or set MODELD_BIN")
    return path


def child_env(extra=None):
    """os.environ without any MODELD_* variable, plus OPENBLAS_NUM_THREADS=1 and `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MODELD_")}
    env["OPENBLAS_NUM_THREADS"] = "1"
    if extra:
        env.update({k: str(v) for k, v in extra.items()})
    return env


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def raw_connect(port, timeout=5.0):
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout * TSCALE)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


class HttpResponse:
    def __init__(self, status, reason, headers, body, raw):
        self.status = status
        self.reason = reason
        self.headers = headers  # lower-case name -> value
        self.body = body
        self.raw = raw

    def json(self):
        return json.loads(self.body)


def read_http_response(sock, timeout=5.0):
    """Read one HTTP/1.1 response from `sock` (Content-Length framed, or until
    close). Raises AssertionError if none arrives completely within `timeout`."""
    deadline = time.monotonic() + timeout * TSCALE
    buf = b""
    while b"\r\n\r\n" not in buf:
        left = deadline - time.monotonic()
        assert left > 0, f"no complete response head within {timeout * TSCALE:.1f} s; got {buf!r}"
        sock.settimeout(left)
        try:
            chunk = sock.recv(65536)
        except socket.timeout:
            raise AssertionError(f"no complete response head within {timeout * TSCALE:.1f} s; "
                                 f"got {buf!r}")
        assert chunk, f"connection closed before a complete response head; got {buf!r}"
        buf += chunk
    head, rest = buf.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    assert len(parts) >= 2 and parts[0].startswith("HTTP/1."), f"bad status line {lines[0]!r}"
    status = int(parts[1])
    reason = parts[2] if len(parts) > 2 else ""
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    body = rest
    if "content-length" in headers:
        want = int(headers["content-length"])
        while len(body) < want:
            left = deadline - time.monotonic()
            assert left > 0, f"response body incomplete after {timeout * TSCALE:.1f} s: {buf!r}"
            sock.settimeout(left)
            chunk = sock.recv(65536)
            assert chunk, f"connection closed inside the response body: {head!r} {body!r}"
            body += chunk
        extra = body[want:]
        body = body[:want]
        assert not extra, f"unexpected bytes after the response: {extra!r}"
    else:
        while True:
            left = deadline - time.monotonic()
            assert left > 0, "response without Content-Length not closed in time"
            sock.settimeout(left)
            chunk = sock.recv(65536)
            if not chunk:
                break
            body += chunk
    return HttpResponse(status, reason, headers, body, head + b"\r\n\r\n" + body)


class Server:
    """One modeld process on a free loopback port."""

    _seq = 0

    def __init__(self, tmp_path, args=(), env=None, access_log=None, drain_seconds=0,
                 port=None, store=None):
        Server._seq += 1
        self.tmp_path = Path(tmp_path)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.store = Path(store) if store else self.tmp_path / "store"
        self.access_log = (self.tmp_path / "access.log") if access_log is None else access_log
        self.stderr_path = self.tmp_path / f"modeld-stderr-{Server._seq}.log"
        self.argv = [modeld_bin(), "--host", "127.0.0.1", "--port", str(self.port),
                     "--store", str(self.store), "--access-log", str(self.access_log),
                     "--drain-seconds", str(drain_seconds), *[str(a) for a in args]]
        self.env = child_env(env)
        self.proc = None
        self._stderr_file = None

    @property
    def stderr(self):
        try:
            return self.stderr_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def start(self, timeout=20.0, ready=True):
        """Start and wait until GET /healthz answers 200; with `ready`, also until
        GET /readyz answers 200 (deployed models loaded). Fails the test with the
        server's stderr if it exits or times out."""
        self._stderr_file = open(self.stderr_path, "wb")
        self.proc = subprocess.Popen(self.argv, env=self.env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=self._stderr_file,
                                     cwd=str(self.tmp_path))
        deadline = time.monotonic() + timeout * TSCALE
        last = None
        probe = "/healthz"
        while time.monotonic() < deadline:
            rc = self.proc.poll()
            if rc is not None:
                pytest.fail(f"modeld exited with {rc} before answering {probe} 200; "
                            f"argv={self.argv}\nstderr:\n{self.stderr}")
            try:
                r = requests.get(self.url + probe, timeout=1.0 * TSCALE)
                if r.status_code == 200:
                    if probe == "/readyz" or not ready:
                        return self
                    probe = "/readyz"
                    continue
                last = f"{probe}: {r.status_code} {r.text!r}"
            except requests.RequestException as e:
                last = repr(e)
            time.sleep(0.02)
        self.kill()
        pytest.fail(f"modeld did not answer GET {probe} 200 within {timeout * TSCALE:.0f} s "
                    f"(last: {last}); stderr:\n{self.stderr}")

    def get(self, path, **kw):
        kw.setdefault("timeout", 5 * TSCALE)
        return requests.get(self.url + path, **kw)

    def request(self, method, path, **kw):
        kw.setdefault("timeout", 5 * TSCALE)
        return requests.request(method, self.url + path, **kw)

    def send_signal(self, sig):
        self.proc.send_signal(sig)

    def stop(self, sig=signal.SIGTERM, timeout=20.0):
        """Send `sig` and wait for the exit; returns the exit code (negative: killed by a signal)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout * TSCALE)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"modeld did not exit within {timeout * TSCALE:.0f} s of signal {sig}; "
                        f"stderr:\n{self.stderr}")

    def finish(self):
        """Teardown: under a sanitizer build, stop with SIGTERM (so LeakSanitizer
        runs at exit) and fail if a sanitizer reported anything during the test;
        else kill at once."""
        if SANITIZED and self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30 * TSCALE)
            except subprocess.TimeoutExpired:
                pass
        self.kill()
        if SANITIZED:
            text = self.stderr
            hits = [m for m in SANITIZER_REPORT if m in text]
            if hits:
                at = min(text.index(m) for m in hits)
                pytest.fail(f"sanitizer report from modeld ({', '.join(hits)}):\n"
                            f"{text[max(0, at - 200):at + 6000]}")

    def kill(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        if self._stderr_file is not None:
            self._stderr_file.close()
            self._stderr_file = None


@pytest.fixture
def tscale():
    return TSCALE


@pytest.fixture
def start_server(tmp_path):
    started = []

    def start(*args, env=None, access_log=None, drain_seconds=0, port=None, store=None,
              wait=True, ready=True, timeout=20.0):
        s = Server(tmp_path, args=args, env=env, access_log=access_log,
                   drain_seconds=drain_seconds, port=port, store=store)
        started.append(s)
        if wait:
            s.start(timeout=timeout, ready=ready)
        return s

    yield start
    for s in started:
        s.finish()


@pytest.fixture
def server(start_server):
    return start_server()


@pytest.fixture(scope="session")
def shared_server(tmp_path_factory):
    """One default server for the whole session, for tests that only read
    (health, errors, request ids): saves a process start per test. Tests that
    change state or read the access log use `server` instead."""
    s = Server(tmp_path_factory.mktemp("shared"))
    try:
        yield s.start()
    finally:
        s.finish()


@pytest.fixture
def run_modeld(tmp_path):
    """Run modeld to completion: run_modeld(*args, env={...}) -> CompletedProcess (text).
    Fails the test if it runs past `timeout` (it would be serving instead of exiting)."""

    def run(*args, env=None, timeout=15.0):
        argv = [modeld_bin(), *[str(a) for a in args]]
        try:
            return subprocess.run(argv, env=child_env(env), cwd=str(tmp_path),
                                  stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                  timeout=timeout * TSCALE)
        except subprocess.TimeoutExpired as e:
            pytest.fail(f"{argv} did not exit within {timeout * TSCALE:.0f} s "
                        f"(stderr: {e.stderr!r})")

    return run


@pytest.fixture
def s3(tmp_path):
    """A real S3 server for the test (tests/e2e/s3.py): s3rver behind the
    SigV4-checking proxy, bucket created; .env() gives a client's AWS_*
    variables, .client() a boto3 client, .pid s3rver's process (to stop)."""
    from s3 import S3Harness
    harness = S3Harness(tmp_path)
    try:
        yield harness.start()
    finally:
        harness.stop()
