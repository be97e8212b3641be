"""
test_blobs_s3.py - checkpoint bytes in S3 with a local cache (blob_url,
issue 25), against the real binary, a real S3 server (s3rver behind the
SigV4-checking proxy: s3.py) and, for two replicas, a real PostgreSQL (pg.py):

- a deploy puts the bytes in S3 before its row commits, under
  blobs/<sha256>/<nonce> (the same bytes twice are two objects); deleting
  versions deletes their objects; --store/blobs is the cache;
- a replica with an empty cache downloads what it serves, checked by sha256;
  a download cut mid-way resumes, and no partial file ever has a final name;
- cache_max_bytes evicts the least recently used files, never one in use;
- s3://BUCKET/KEY as a deploy source, which boto3 put there the way users
  do, allowed only under allowed_s3 (403 naming the setting otherwise);
- faults: s3rver stopped (SIGSTOP) during a deploy answers 503 and stores
  nothing while loaded versions keep serving; start-up with S3 unreachable
  marks nothing failed and loads the default once S3 is back;
- two replicas (one PostgreSQL index, one bucket, their own caches): deploy
  through A, predict through B; B cut off from S3 keeps serving the old
  default and takes the new one once it can fetch it.

No test waits on a clock for ordering: everything polls with a deadline.
MD_TEST_S3_STALL_S shortens the low-speed window that turns a stalled S3
into 503 (15 s in production) so the stall tests finish sooner.
"""
import hashlib
import json
import os
import signal
import socket
import subprocess
import threading
import time

import pytest
import requests

from conftest import REPO, TSCALE, free_port

FIXTURES = REPO / "tests" / "fixtures"
MLP = (FIXTURES / "mlp.pt").read_bytes()
CNN = (FIXTURES / "cnn.pt").read_bytes()
MLP_CONFIG = {"input": {"shape": [4]}, "output": "logits"}
MLP_IN = json.loads((FIXTURES / "mlp_input.json").read_text())
CNN_IN = json.loads((FIXTURES / "cnn_input.json").read_text())
CNN_CONFIG = {"input": {"shape": [1, 8, 8]}}
PREFIX = "modeld"


def sha(b):
    return hashlib.sha256(b).hexdigest()


def upload(srv, name, data=MLP, config=MLP_CONFIG, timeout=60, **fields):
    form = {"config": json.dumps(config)}
    form.update({k: (v if isinstance(v, str) else json.dumps(v)) for k, v in fields.items()})
    return requests.post(srv.url + f"/models/{name}/versions", data=form,
                         files={"checkpoint": ("model.pt", data, "application/octet-stream")},
                         timeout=timeout * TSCALE)


def created(r):
    assert r.status_code == 201, f"expected 201, got {r.status_code}: {r.text!r}"
    return r.json()


def code(r):
    return r.json()["error"]["code"]


def poll(fn, what, timeout=30.0):
    """Call fn() until it returns a true value; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout * TSCALE
    last = None
    while time.monotonic() < deadline:
        try:
            last = fn()
        except requests.RequestException as e:
            last = e
        else:
            if last:
                return last
        time.sleep(0.05)
    pytest.fail(f"{what}: not within {timeout * TSCALE:.0f} s (last: {last!r})")


def predict(srv, name="m", rows=MLP_IN, timeout=30):
    return srv.request("POST", f"/models/{name}/predict", json=rows, timeout=timeout * TSCALE)


def s3_env(s3, endpoint=None, **extra):
    env = s3.env()
    env["MD_TEST_S3_STALL_S"] = "3"
    if endpoint:
        env["AWS_ENDPOINT_URL_S3"] = endpoint
    env.update(extra)
    return env


def s3_start(start_server, s3, *args, store=None, endpoint=None, ready=True, env=None):
    e = s3_env(s3, endpoint)
    e.update(env or {})
    return start_server("--blob-url", f"s3://{s3.bucket}/{PREFIX}", "--store-poll-ms", "50",
                        *args, env=e, store=store, ready=ready, timeout=60)


def objects(s3, prefix=PREFIX + "/blobs/"):
    out = s3.client().list_objects_v2(Bucket=s3.bucket, Prefix=prefix)
    return sorted(o["Key"] for o in out.get("Contents", []))


def cache_files(store):
    d = store / "blobs"
    return sorted(p.name for p in d.iterdir()) if d.is_dir() else []


def assert_cache_whole(store):
    """Every file under a final name in the cache holds the bytes it names."""
    for name in cache_files(store):
        assert sha((store / "blobs" / name).read_bytes()) == name, f"blobs/{name} is not whole"


def metric(text, sample):
    """The value of one sample line (`name` or `name{labels}`) of /metrics."""
    for line in text.splitlines():
        if line.startswith(sample + " "):
            return float(line.split()[-1])
    pytest.fail(f"no sample {sample} in /metrics")


def harness_stats(s3):
    text = requests.get(s3.endpoint + "/__harness__/stats", timeout=10).text
    return {k: int(v) for k, v in (p.split("=") for p in text.split())}


class Relay:
    """A TCP relay to the S3 proxy that a test can cut: closed, a replica
    behind it finds S3 gone (connection refused), as a partition does."""

    def __init__(self, target_port):
        self.target = target_port
        self.port = free_port()
        self.lsock = None
        self.conns = []
        self.lock = threading.Lock()

    @property
    def endpoint(self):
        return "http://127.0.0.1:%d" % self.port

    def open(self):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", self.port))
        s.listen(64)
        self.lsock = s
        threading.Thread(target=self._accept, args=(s,), daemon=True).start()

    def _accept(self, s):
        while True:
            try:
                c, _ = s.accept()
            except OSError:
                return
            try:
                u = socket.create_connection(("127.0.0.1", self.target), timeout=10)
            except OSError:
                c.close()
                continue
            with self.lock:
                self.conns += [c, u]
            threading.Thread(target=self._pump, args=(c, u), daemon=True).start()
            threading.Thread(target=self._pump, args=(u, c), daemon=True).start()

    def _pump(self, a, b):
        try:
            while True:
                data = a.recv(65536)
                if not data:
                    break
                b.sendall(data)
        except OSError:
            pass
        for x in (a, b):
            try:
                x.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self):
        if self.lsock:
            try:
                # wakes the accept() blocked in the other thread (Linux): a
                # close alone leaves the socket listening until it returns
                self.lsock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self.lsock.close()
            self.lsock = None
        with self.lock:
            for c in self.conns:
                try:
                    c.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                c.close()
            self.conns = []


# ------------------------------------------------------------ the basics


def test_a_deploy_puts_the_bytes_in_s3_and_a_delete_takes_them_away(start_server, s3):
    srv = s3_start(start_server, s3)
    v1 = created(upload(srv, "m"))
    assert v1["version"] == 1 and v1["sha256"] == sha(MLP), v1
    keys = objects(s3)
    assert len(keys) == 1 and keys[0].startswith(f"{PREFIX}/blobs/{sha(MLP)}/"), keys
    got = s3.client().get_object(Bucket=s3.bucket, Key=keys[0])["Body"].read()
    assert got == MLP
    assert cache_files(srv.store) == [sha(MLP)]
    assert_cache_whole(srv.store)
    r = predict(srv)
    assert r.status_code == 200 and r.json()["version"] == 1, r.text

    # a deploy refused at its commit (an explicit duplicate number) took its
    # object away again before answering
    r = upload(srv, "m", data=CNN, config=CNN_CONFIG, version="1")
    assert r.status_code == 409 and code(r) == "version_exists", r.text
    assert objects(s3) == keys

    # the same bytes again: stored once
    created(upload(srv, "m", deploy="false"))
    assert objects(s3) == keys
    r = srv.request("DELETE", "/models/m/versions/2")
    assert r.status_code in (200, 204), r.text
    assert objects(s3) == keys  # version 1 still names those bytes
    assert predict(srv).status_code == 200

    r = srv.request("DELETE", "/models/m")
    assert r.status_code in (200, 204), r.text
    poll(lambda: objects(s3) == [], "the model's objects are deleted")


def test_an_empty_cache_downloads_and_a_cut_download_resumes(start_server, s3):
    srv = s3_start(start_server, s3)
    created(upload(srv, "m"))
    store = srv.store
    srv.stop()
    for name in cache_files(store):
        (store / "blobs" / name).unlink()
    # the next GET answers 1000 bytes, then the connection closes
    s3.cut_next_get(1000)
    before = harness_stats(s3)["cuts"]
    srv = s3_start(start_server, s3, store=store)
    r = predict(srv)
    assert r.status_code == 200 and r.json()["version"] == 1, r.text
    assert harness_stats(s3)["cuts"] == before + 1, "the download was not cut"
    assert cache_files(store) == [sha(MLP)]
    assert_cache_whole(store)
    assert not [p for p in (store / "tmp").iterdir() if "fetch" in p.name], "a temp file stayed"
    assert srv.get("/models/m/versions/1").json()["state"] == "ready"


def test_an_object_changed_outside_modeld_never_gets_a_final_name(start_server, s3):
    srv = s3_start(start_server, s3)
    created(upload(srv, "m"))
    store = srv.store
    srv.stop()
    for name in cache_files(store):
        (store / "blobs" / name).unlink()
    key = objects(s3)[0]
    s3.client().put_object(Bucket=s3.bucket, Key=key, Body=CNN)  # other bytes, same key
    srv = s3_start(start_server, s3, store=store)
    assert cache_files(store) == [], "bytes that are not the version's got a final name"
    assert not [p for p in (store / "tmp").iterdir() if "fetch" in p.name], "a temp file stayed"
    v = srv.get("/models/m/versions/1").json()
    assert v["state"] == "failed" and sha(CNN) in v["state_reason"], v
    assert predict(srv).status_code != 200


def test_cache_max_bytes_evicts_the_least_recently_used(start_server, s3):
    bound = max(len(MLP), len(CNN)) + 1  # room for one of the two
    srv = s3_start(start_server, s3, "--cache-max-bytes", str(bound))
    created(upload(srv, "m"))
    created(upload(srv, "c", data=CNN, config=CNN_CONFIG))
    # deploys fill the cache too: the older file went when the newer came
    assert cache_files(srv.store) == [sha(CNN)]
    assert predict(srv).status_code == 200  # loaded: served from memory
    store = srv.store
    srv.stop()
    for name in cache_files(store):
        (store / "blobs" / name).unlink()
    srv = s3_start(start_server, s3, "--cache-max-bytes", str(bound), store=store)
    # both defaults loaded at start (each file read while pinned), then the
    # older evicted: what is loaded keeps serving from memory
    assert predict(srv).status_code == 200
    files = cache_files(store)
    assert len(files) == 1, files
    assert sum((store / "blobs" / f).stat().st_size for f in files) <= bound
    assert_cache_whole(store)
    assert "evicted" in srv.stderr
    text = srv.get("/metrics").text
    assert metric(text, "modeld_blob_evictions_total") >= 1, text
    assert metric(text, 'modeld_blob_fetches_total{result="download"}') == 2, text
    assert metric(text, "modeld_blob_cache_bytes") <= bound
    assert metric(text, "modeld_blob_cache_max_bytes") == bound
    promtool = os.environ.get("PROMTOOL")
    if promtool:
        p = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True,
                           text=True, timeout=60)
        assert p.returncode == 0, p.stdout + p.stderr


def test_architectures_state_dicts_and_averages_live_in_s3(start_server, s3, tmp_path):
    ck = FIXTURES / "ckpt"
    arch, sd, sft = (ck / "mlp_arch.pt").read_bytes(), (ck / "mlp_sd.pt").read_bytes(), \
        (ck / "mlp.safetensors").read_bytes()
    srv = s3_start(start_server, s3)
    r = srv.request("PUT", "/models/t/architecture", data=arch, timeout=60)
    assert r.status_code == 200, r.text
    created(upload(srv, "t", data=sd, config={"input": {"shape": [4]}}))
    created(upload(srv, "t", data=sft))
    avg = created(srv.request("POST", "/models/t/versions", json={
        "average": {"versions": [1, 2]}, "make_default": False}, timeout=60))
    keys = objects(s3)
    for b in (arch, sd, sft):
        assert any(sha(b) in k for k in keys), (sha(b), keys)
    assert any(avg["sha256"] in k for k in keys), keys
    want = predict(srv, "t").json()["predictions"]
    store = srv.store
    srv.stop()
    for name in cache_files(store):
        (store / "blobs" / name).unlink()
    # an empty cache: every file comes back from S3 when it is needed
    srv = s3_start(start_server, s3, store=store)
    r = predict(srv, "t")
    assert r.status_code == 200 and r.json()["predictions"] == want, r.text
    r = srv.request("POST", f"/models/t/versions/{avg['version']}/predict", json=MLP_IN,
                    timeout=60)
    assert r.status_code == 200, r.text
    r = srv.get("/models/t/versions/1/checkpoint", timeout=60)
    assert r.status_code == 200 and r.content == sd
    r = srv.get("/models/t/versions/1/checkpoint?format=safetensors", timeout=60)
    assert r.status_code == 200 and r.content[:8], r.text
    r = srv.get("/models/t/architecture", timeout=60)
    assert r.status_code == 200, r.text
    assert_cache_whole(store)


# ------------------------------------------------------------ s3:// sources


def test_an_s3_source_put_by_boto3_deploys_only_under_allowed_s3(start_server, s3, tmp_path):
    f = tmp_path / "model.pt"
    f.write_bytes(MLP)
    c = s3.client()
    c.upload_file(str(f), s3.bucket, "models/fashion/model.pt")
    c.upload_file(str(f), s3.bucket, "private/model.pt")
    # no blob_url: s3:// sources work with the directory store too
    srv = start_server("--allowed-s3", f"{s3.bucket}/models", env=s3_env(s3))
    src = f"s3://{s3.bucket}/models/fashion/model.pt"
    r = srv.request("POST", "/models", json={"name": "m", "source": src, "sha256": sha(MLP),
                                             "config": MLP_CONFIG}, timeout=60)
    v = created(r)
    assert v["source"] == src and v["sha256"] == sha(MLP), v
    r = predict(srv)
    assert r.status_code == 200, r.text

    r = srv.request("POST", "/models", json={"name": "p", "source": f"s3://{s3.bucket}/private/"
                                             "model.pt"})
    assert r.status_code == 403 and code(r) == "source_not_allowed", r.text
    assert "allowed_s3" in r.json()["error"]["message"]
    # no way out of the allowed prefix through ".." (or "." or "//")
    for key in ("models/../private/model.pt", "models/./x.pt", "models//x.pt"):
        r = srv.request("POST", "/models", json={"name": "p", "source": f"s3://{s3.bucket}/{key}"})
        assert r.status_code == 400 and code(r) == "invalid_source", (key, r.text)
    # a prefix matches at a '/' boundary only
    r = srv.request("POST", "/models", json={"name": "p", "source": f"s3://{s3.bucket}/models2/"
                                             "x.pt"})
    assert r.status_code == 403 and code(r) == "source_not_allowed", r.text
    r = srv.request("POST", "/models", json={"name": "p", "source": src, "sha256": sha(CNN)})
    assert r.status_code == 400 and code(r) == "sha256_mismatch", r.text
    r = srv.request("POST", "/models", json={"name": "p", "source": f"s3://{s3.bucket}/models/"
                                             "missing.pt"}, timeout=60)
    assert r.status_code == 404 and code(r) == "source_not_found", r.text
    assert srv.get("/models/p").status_code == 404

    # not allowed at all without allowed_s3
    srv2 = start_server(env=s3_env(s3))
    r = srv2.request("POST", "/models", json={"name": "m", "source": src})
    assert r.status_code == 403 and code(r) == "source_not_allowed", r.text
    assert "allowed_s3" in r.json()["error"]["message"]


def test_secrets_never_in_print_config(run_modeld, s3):
    p = run_modeld("--print-config", "--blob-url", "s3://b/p", "--allowed-s3", "b/models",
                   env=s3.env())
    assert p.returncode == 0, p.stderr
    cfg = json.loads(p.stdout)
    assert cfg["blob_url"] == "s3://b/p" and cfg["allowed_s3"] == ["b/models"], cfg
    assert cfg["s3_path_style"] == "auto" and cfg["cache_max_bytes"] == 0, cfg
    assert s3.secret not in p.stdout and s3.secret not in p.stderr


# ------------------------------------------------------------ faults


def test_s3_stalled_a_deploy_answers_503_and_stores_nothing(start_server, s3):
    # something of the operator's under the prefix: not modeld's to sweep
    s3.client().put_object(Bucket=s3.bucket, Key=f"{PREFIX}/blobs/README.txt", Body=b"mine")
    srv = s3_start(start_server, s3, env={"MD_TEST_ORPHAN_GRACE_S": "2"})
    created(upload(srv, "m"))
    os.kill(s3.pid, signal.SIGSTOP)
    try:
        r = upload(srv, "m", data=CNN, config=CNN_CONFIG)
        assert r.status_code == 503 and code(r) == "s3_unavailable", r.text
        assert "Retry-After" in r.headers
        assert s3.secret not in r.text and s3.secret not in srv.stderr
        m = srv.get("/models/m").json()
        assert [v["version"] for v in m["versions"]] == [1], m
        # the cached, loaded version keeps serving
        r = predict(srv)
        assert r.status_code == 200 and r.json()["version"] == 1, r.text
    finally:
        os.kill(s3.pid, signal.SIGCONT)
    # S3 back: a deploy works, and the failed one allocated no number
    v = created(upload(srv, "m", deploy="false"))
    assert v["version"] == 2, v
    # the stalled PUT may still have landed once s3rver went on: an object
    # no row names, which the orphan sweep deletes after its grace period
    poll(lambda: all(sha(CNN) not in k for k in objects(s3)), "the orphan is swept", 60)
    assert any(sha(MLP) in k for k in objects(s3)), objects(s3)
    assert f"{PREFIX}/blobs/README.txt" in objects(s3)


def test_start_with_s3_unreachable_marks_nothing_failed(start_server, s3):
    srv = s3_start(start_server, s3)
    created(upload(srv, "m"))
    store = srv.store
    srv.stop()
    for name in cache_files(store):
        (store / "blobs" / name).unlink()
    os.kill(s3.pid, signal.SIGSTOP)
    try:
        srv = s3_start(start_server, s3, store=store)
        v = srv.get("/models/m/versions/1").json()
        assert v["state"] != "failed", v
        r = predict(srv)
        assert r.status_code == 503, r.text
        assert srv.get("/models/m/versions/1").json()["state"] != "failed"
        assert cache_files(store) == []
    finally:
        os.kill(s3.pid, signal.SIGCONT)
    # S3 back: the store sync loads the default by itself
    poll(lambda: predict(srv).status_code == 200, "the default loads once S3 is back", 60)
    assert srv.get("/models/m/versions/1").json()["state"] == "ready"
    assert_cache_whole(store)


# ------------------------------------------------------------ two replicas


def test_two_replicas_deploy_through_a_predict_through_b(start_server, s3, pg_url, tmp_path):
    relay = Relay(s3.proxy.server_address[1])
    relay.open()
    try:
        a = s3_start(start_server, s3, "--index-url", pg_url, store=tmp_path / "a")
        created(upload(a, "m"))
        b = s3_start(start_server, s3, "--index-url", pg_url, store=tmp_path / "b",
                     endpoint=relay.endpoint)
        r = predict(b)
        assert r.status_code == 200 and r.json()["version"] == 1, r.text
        assert cache_files(tmp_path / "b") == [sha(MLP)], "B did not download into its cache"
        assert_cache_whole(tmp_path / "b")

        # B loses S3; A deploys a new default B cannot fetch
        relay.close()
        v2 = created(upload(a, "m", data=CNN, config=CNN_CONFIG))
        assert v2["version"] == 2 and v2["default"] is True, v2
        poll(lambda: "version 2 cannot be loaded now" in b.stderr, "B tried to load version 2")
        r = predict(b)
        assert r.status_code == 200 and r.json()["version"] == 1, r.text  # the old one serves
        assert b.get("/models/m/versions/2").json()["state"] != "failed"

        # S3 back for B: its store sync retries and serves version 2
        relay.open()
        poll(lambda: predict(b, rows=CNN_IN).json().get("version") == 2,
             "B serves version 2 once it can fetch it", 60)
        assert sha(CNN) in cache_files(tmp_path / "b")
        assert_cache_whole(tmp_path / "b")
    finally:
        relay.close()


def test_two_replicas_deploying_the_same_bytes_at_once_keep_one_object(start_server, s3, pg_url,
                                                                       tmp_path):
    env = {"MD_TEST_ORPHAN_GRACE_S": "2"}  # also wakes the collector every second
    a = s3_start(start_server, s3, "--index-url", pg_url, store=tmp_path / "a", env=env)
    b = s3_start(start_server, s3, "--index-url", pg_url, store=tmp_path / "b", env=env)
    results = []

    def deploy(srv):
        for _ in range(3):
            results.append(upload(srv, "m", deploy="false").status_code)

    threads = [threading.Thread(target=deploy, args=(srv,)) for srv in (a, b, a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120 * TSCALE)
    assert results == [201] * 12, results
    m = a.get("/models/m").json()
    assert sorted(v["version"] for v in m["versions"]) == list(range(1, 13)), m
    # racing uploads may each have put an object; one stays, the rest go
    poll(lambda: len(objects(s3)) == 1, "one object for the bytes", 60)
    assert sha(MLP) in objects(s3)[0]
    for srv in (a, b):
        r = srv.request("POST", "/models/m/versions/12/predict", json=MLP_IN, timeout=60)
        assert r.status_code == 200, r.text

