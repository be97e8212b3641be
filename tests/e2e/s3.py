"""
s3.py - a real S3 server for the tests: npm's s3rver behind a proxy that
checks AWS Signature Version 4 the way S3 does.

s3rver stores objects for real but checks no V4 signature (any secret gets
200 as long as the access key id is its own, S3RVER), so a suite that only
talks to it cannot catch a signing bug. SigV4Proxy sits in front of it: it
recomputes every request's signature with botocore from the method, the path
and query as received (decoded and re-encoded, as S3 canonicalises them), the
signed headers and x-amz-content-sha256, with the one secret it knows, and
answers 403 SignatureDoesNotMatch XML on a mismatch or an unsigned request;
it checks the body against x-amz-content-sha256 (400
XAmzContentSHA256Mismatch), then forwards, streaming bodies both ways (a
request body is spooled to disk, never held whole in memory).

The proxy has one fault knob, for the download-resume tests: a POST to
/__harness__/cut?after=N makes the next object GET answer its full headers
and only N bytes of body, then close the connection. GET /__harness__/stats
answers "refused=N forwarded=N cuts=N lists=N parts=N ranges=N" (lists:
ListObjectsV2 pages; parts: UploadPart requests; ranges: GETs with a Range).
S3Harness.deny_listing(prefix) makes listings under a prefix answer 403
AccessDenied, as for a credential without s3:ListBucket.

Used three ways:
  - the pytest fixture `s3` (tests/e2e/conftest.py imports it): an S3Harness
    started for the test, with .env() for the AWS_* variables of a client;
  - `tests/with_s3.sh CMD...` (= `python3 tests/e2e/s3.py run -- CMD...`):
    starts s3rver and the proxy, creates the bucket, runs CMD with the AWS_*
    variables exported (plus S3_URL, S3_BUCKET, S3RVER_PID,
    S3_HARNESS_CONTROL), stops both and exits with CMD's status;
  - `python3 tests/e2e/s3.py serve`: the same, until interrupted, printing
    the variables (to try a client by hand).
s3rver comes from `make s3rver` (build/tools/s3rver, pinned by
tests/s3rver/package-lock.json); S3RVER_JS overrides where it is.
"""
import hashlib
import http.client
import http.server
import os
import re
import secrets
import select
import shutil
import signal
import socketserver
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
S3RVER_JS = Path(os.environ.get("S3RVER_JS") or
                 REPO / "build/tools/s3rver/node_modules/s3rver/bin/s3rver.js")
ACCESS_KEY = "S3RVER"  # the only access key id s3rver knows
REGION = "us-east-1"
BUCKET = "modeld-test"
CONTROL = "/__harness__"
UNSIGNED = "UNSIGNED-PAYLOAD"
HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te",
              "trailer", "upgrade", "expect"}


def _xml_error(code, message):
    return ('<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>%s</Code><Message>%s</Message>'
            '<RequestId>harness</RequestId></Error>' % (code, message)).encode()


_AUTH_RE = re.compile(r"AWS4-HMAC-SHA256\s+Credential=([^/,\s]+)/(\d{8})/([^/,\s]+)/s3/aws4_request"
                      r"\s*,\s*SignedHeaders=([a-z0-9;-]+)\s*,\s*Signature=([0-9a-f]{64})$")


def expected_signature(secret, method, raw_path, headers, signed_names, date, region):
    """The SigV4 signature S3 would compute for this request, by botocore:
    the path and each query pair decoded and re-encoded (RFC 3986, '/' kept
    in the path), the query sorted, the signed headers as received."""
    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    path, _, query = raw_path.partition("?")
    canon_path = urllib.parse.quote(urllib.parse.unquote(path), safe="/~")
    params = []
    if query:
        for pair in query.split("&"):
            k, _, v = pair.partition("=")
            params.append((urllib.parse.unquote(k), urllib.parse.unquote(v)))
    signed = {}
    for name in signed_names:
        values = headers.get_all(name) or []
        if not values:
            return None  # a signed header that did not arrive
        signed[name] = ",".join(values)
    req = AWSRequest(method=method, url="http://%s%s" % (signed.get("host", "unknown"), canon_path),
                     headers=signed, params=params)
    req.context["timestamp"] = date
    auth = S3SigV4Auth(Credentials(ACCESS_KEY, secret), "s3", region)
    canonical = auth.canonical_request(req)
    return auth.signature(auth.string_to_sign(req, canonical), req)


class _Spooled:
    """A request body on disk with its sha256."""

    def __init__(self, f):
        self.f = f
        self.h = hashlib.sha256()
        self.sha256 = None

    def write(self, chunk):
        self.h.update(chunk)
        self.f.write(chunk)

    def rewind(self):
        self.sha256 = self.h.hexdigest()
        self.f.seek(0)

    def read(self, n):
        return self.f.read(n)

    def close(self):
        self.f.close()


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "s3-sigv4-proxy"

    def log_message(self, fmt, *args):  # quiet: pytest shows failures, not traffic
        if os.environ.get("S3_HARNESS_VERBOSE"):
            sys.stderr.write("s3 proxy: " + fmt % args + "\n")

    def _answer(self, status, body, content_type="application/xml"):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _refuse(self, status, code, message):
        self.server.refused += 1
        self._drain_body()
        self._answer(status, _xml_error(code, message))

    def _drain_body(self):
        n = int(self.headers.get("Content-Length") or 0)
        while n > 0:
            chunk = self.rfile.read(min(n, 65536))
            if not chunk:
                break
            n -= len(chunk)

    def _control(self):
        parts = urllib.parse.urlsplit(self.path)
        q = dict(urllib.parse.parse_qsl(parts.query))
        if parts.path == CONTROL + "/cut" and "after" in q:
            self.server.cut_after = int(q["after"])
            self._answer(200, b"ok\n", "text/plain")
        elif parts.path == CONTROL + "/stats":
            srv = self.server
            self._answer(200, ("refused=%d forwarded=%d cuts=%d lists=%d parts=%d ranges=%d\n" % (
                srv.refused, srv.forwarded, srv.cuts, srv.lists, srv.parts,
                srv.ranges)).encode(), "text/plain")
        else:
            self._answer(404, b"unknown harness control\n", "text/plain")

    def _check(self, body_file):
        """None when the request is signed right, else (status, code, message)."""
        auth = self.headers.get("Authorization")
        if not auth:
            return 403, "AccessDenied", "Anonymous access is refused: sign the request (SigV4)"
        m = _AUTH_RE.match(auth.strip())
        if not m:
            return 400, "AuthorizationHeaderMalformed", "not an AWS4-HMAC-SHA256 header for s3"
        key, day, region, names, given = m.groups()
        if key != ACCESS_KEY:
            return 403, "InvalidAccessKeyId", "The AWS Access Key Id you provided does not exist"
        if region != self.server.region:
            return 400, "AuthorizationHeaderMalformed", \
                "the region '%s' is wrong; expecting '%s'" % (region, self.server.region)
        date = self.headers.get("x-amz-date")
        if not date or not date.startswith(day):
            return 403, "SignatureDoesNotMatch", "x-amz-date is missing or not the credential's day"
        signed = names.split(";")
        if "host" not in signed or "x-amz-content-sha256" not in signed:
            return 403, "SignatureDoesNotMatch", "host and x-amz-content-sha256 must be signed"
        payload = self.headers.get("x-amz-content-sha256")
        if payload != UNSIGNED and body_file is not None:
            if payload != body_file.sha256:
                return 400, "XAmzContentSHA256Mismatch", \
                    "The provided 'x-amz-content-sha256' header does not match what was computed."
        want = expected_signature(self.server.secret, self.command, self.path, self.headers, signed,
                                  date, region)
        if want != given:
            return 403, "SignatureDoesNotMatch", ("The request signature we calculated does not match "
                                                  "the signature you provided. Check your key and "
                                                  "signing method.")
        return None

    def _spool_body(self):
        """The request body in a temp file with its sha256, or None without one."""
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            return "chunked"
        n = int(self.headers.get("Content-Length") or 0)
        if self.command in ("GET", "HEAD", "DELETE") and n == 0:
            return None
        f = _Spooled(tempfile.TemporaryFile(dir=self.server.spool_dir))
        left = n
        while left > 0:
            chunk = self.rfile.read(min(left, 1 << 16))
            if not chunk:
                f.close()
                return "short"
            f.write(chunk)
            left -= len(chunk)
        f.rewind()
        return f

    def _handle(self):
        if self.path.startswith(CONTROL):
            return self._control()
        body = self._spool_body()
        if body in ("chunked", "short"):
            self._refuse(400, "IncompleteBody", "the body is chunked or shorter than its length")
            self.close_connection = True
            return
        problem = self._check(body)
        if problem:
            if body is not None:
                body.close()
            self.server.refused += 1
            self._answer(problem[0], _xml_error(problem[1], problem[2]))
            return
        listing = self.command == "GET" and "list-type=2" in urllib.parse.urlsplit(self.path).query
        deny = self.server.deny_list_prefix
        if listing and deny is not None:
            q = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(self.path).query))
            if q.get("prefix", "").startswith(deny):
                if body is not None:
                    body.close()
                self._refuse(403, "AccessDenied", "not authorized to perform: s3:ListBucket")
                return
        self.server.forwarded += 1
        if listing:
            self.server.lists += 1
        query = urllib.parse.urlsplit(self.path).query
        if self.command == "PUT" and "partNumber=" in query and "uploadId=" in query:
            self.server.parts += 1
        if self.command == "GET" and self.headers.get("Range"):
            self.server.ranges += 1
        try:
            self._forward(body)
        finally:
            if body is not None:
                body.close()

    def _forward(self, body):
        up = http.client.HTTPConnection("127.0.0.1", self.server.upstream_port, timeout=120)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
        up.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
        for k, v in headers.items():
            up.putheader(k, v)
        if body is None and "content-length" not in {k.lower() for k in headers}:
            if self.command in ("PUT", "POST"):
                up.putheader("Content-Length", "0")
        up.endheaders()
        if body is not None:
            while True:
                chunk = body.read(1 << 16)
                if not chunk:
                    break
                up.send(chunk)
        resp = up.getresponse()
        cut = None
        if self.command == "GET" and self.server.cut_after is not None and resp.status in (200, 206) \
                and not urllib.parse.urlsplit(self.path).query:
            cut, self.server.cut_after = self.server.cut_after, None
        self.send_response(resp.status, resp.reason)
        length = resp.getheader("Content-Length")
        for k, v in resp.getheaders():
            if k.lower() not in HOP_BY_HOP:
                self.send_header(k, v)
        if length is None and self.command != "HEAD" and resp.status not in (204, 304):
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        sent = 0
        if self.command != "HEAD":
            while True:
                chunk = resp.read(1 << 16)
                if not chunk:
                    break
                if cut is not None and sent + len(chunk) > cut:
                    self.wfile.write(chunk[:cut - sent])
                    self.wfile.flush()
                    self.server.cuts += 1
                    self.close_connection = True
                    break
                self.wfile.write(chunk)
                sent += len(chunk)
        up.close()

    do_GET = do_PUT = do_HEAD = do_DELETE = do_POST = _handle


class SigV4Proxy(socketserver.ThreadingMixIn, http.server.HTTPServer):
    """The signature-checking proxy on 127.0.0.1 (port 0: a free one)."""
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, upstream_port, secret, spool_dir, region=REGION, port=0):
        super().__init__(("127.0.0.1", port), _Handler)
        self.upstream_port = upstream_port
        self.secret = secret
        self.region = region
        self.spool_dir = spool_dir
        self.cut_after = None
        self.deny_list_prefix = None
        self.refused = self.forwarded = self.cuts = self.lists = self.parts = self.ranges = 0
        self.thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05},
                                       daemon=True)

    def start(self):
        self.thread.start()
        return self

    def handle_error(self, request, client_address):
        # a client that hung up (a timed-out call, a cut test) is not news
        if isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            return
        super().handle_error(request, client_address)

    def stop(self):
        self.shutdown()
        self.server_close()


class S3Harness:
    """s3rver on a free port with a private directory, the proxy in front,
    and the bucket created through the proxy (signed by boto3)."""

    def __init__(self, workdir, bucket=BUCKET):
        self.workdir = Path(workdir)
        self.bucket = bucket
        self.secret = secrets.token_urlsafe(30)  # a fresh secret each run
        self.proc = None
        self.proxy = None
        self.upstream_port = None

    def start(self, timeout=30.0):
        if not S3RVER_JS.is_file():
            raise RuntimeError("s3rver is not installed at %s: run `make s3rver`" % S3RVER_JS)
        data = self.workdir / "s3rver-data"
        spool = self.workdir / "s3-spool"
        data.mkdir(parents=True, exist_ok=True)
        spool.mkdir(parents=True, exist_ok=True)
        self.log = open(self.workdir / "s3rver.log", "w+b")
        # --openssl-legacy-provider: without it paginated listings fail (s3rver
        # hashes continuation tokens with a cipher OpenSSL 3 keeps there)
        self.proc = subprocess.Popen(
            ["node", "--openssl-legacy-provider", str(S3RVER_JS), "-d", str(data), "-a", "127.0.0.1",
             "-p", "0"], stdout=subprocess.PIPE, stderr=self.log, stdin=subprocess.DEVNULL,
            start_new_session=True)
        deadline = time.monotonic() + timeout
        seen = b""
        # the port it chose, from "S3rver listening on 127.0.0.1:PORT"; read
        # with a deadline, so a server that never says it is up fails the start
        fd = self.proc.stdout.fileno()
        while time.monotonic() < deadline and not self.upstream_port:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            seen += chunk
            m = re.search(rb"listening on 127\.0\.0\.1:(\d+)\n", seen)
            if m:
                self.upstream_port = int(m.group(1))
        if not self.upstream_port:
            self.stop()
            raise RuntimeError("s3rver did not start: %s" % self._log_tail())
        threading.Thread(target=self._drain_stdout, args=(fd,), daemon=True).start()
        self.proxy = SigV4Proxy(self.upstream_port, self.secret, str(spool)).start()
        self.client().create_bucket(Bucket=self.bucket)
        return self

    def _drain_stdout(self, fd):
        try:
            while os.read(fd, 4096):
                pass
        except OSError:
            pass

    def _log_tail(self):
        try:
            self.log.seek(0)
            return self.log.read()[-2000:].decode(errors="replace")
        except (OSError, ValueError):
            return ""

    @property
    def endpoint(self):
        return "http://127.0.0.1:%d" % self.proxy.server_address[1]

    @property
    def url(self):
        return "s3://%s" % self.bucket

    @property
    def pid(self):
        return self.proc.pid

    def env(self, secret=None):
        """The AWS_* variables of a client of this server (nothing else of the
        caller's AWS configuration leaks in)."""
        return {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": self.secret if secret is None else secret,
            "AWS_REGION": REGION,
            "AWS_ENDPOINT_URL_S3": self.endpoint,
            "AWS_CONFIG_FILE": "/dev/null",
            "AWS_SHARED_CREDENTIALS_FILE": "/dev/null",
            "S3_URL": self.url,
            "S3_BUCKET": self.bucket,
            "S3RVER_PID": str(self.pid),
            "S3_HARNESS_CONTROL": self.endpoint + CONTROL,
        }

    def client(self, secret=None):
        """A boto3 client through the proxy, as a user's script makes one."""
        import boto3
        from botocore.config import Config
        return boto3.client(
            "s3", endpoint_url=self.endpoint, region_name=REGION, aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=self.secret if secret is None else secret,
            config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1},
                          connect_timeout=5, read_timeout=30))

    def cut_next_get(self, after):
        self.proxy.cut_after = after

    def deny_listing(self, prefix):
        """ListObjectsV2 under `prefix` answers 403 AccessDenied, as for a
        credential without s3:ListBucket there; None lifts it."""
        self.proxy.deny_list_prefix = prefix

    def stop(self):
        if self.proxy:
            self.proxy.stop()
            self.proxy = None
        if self.proc and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGCONT)  # a test may have stopped it
                self.proc.terminate()
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            except ProcessLookupError:
                pass
        if self.proc and self.proc.stdout:
            self.proc.stdout.close()
        if getattr(self, "log", None):
            self.log.close()


def _main(argv):
    if len(argv) < 2 or argv[1] not in ("run", "serve"):
        sys.stderr.write("usage: s3.py run -- CMD [ARGS...] | s3.py serve\n")
        return 2
    # SIGTERM (a CI timeout, say) still stops s3rver: it runs in a session of its own
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    work = tempfile.mkdtemp(prefix="modeld-s3-")
    harness = S3Harness(work)
    try:
        harness.start()
        env = dict(os.environ)
        env.pop("AWS_SESSION_TOKEN", None)
        env.pop("AWS_PROFILE", None)
        env.update(harness.env())
        if argv[1] == "serve":
            for k, v in harness.env().items():
                print("export %s=%s" % (k, v), flush=True)
            signal.sigwait({signal.SIGINT, signal.SIGTERM})
            return 0
        cmd = argv[2:]
        if cmd and cmd[0] == "--":
            cmd = cmd[1:]
        if not cmd:
            sys.stderr.write("s3.py run: no command given\n")
            return 2
        return subprocess.call(cmd, env=env)
    finally:
        harness.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "serve":
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    sys.exit(_main(sys.argv))
