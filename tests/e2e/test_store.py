"""
test_store.py - the checkpoint store seen through HTTP, against the real
binary: uploads (multipart and raw), registration from URLs (http and file),
content-addressed blobs, every error leaving nothing behind, listing and
reading, rolling the default, deleting, retention, restarts, a missing blob,
kill -9 in the middle of an upload, and an upload that outlives SIGTERM.
"""
import hashlib
import json
import os
import signal
import threading
import time

import pytest
import requests

from conftest import REPO, TSCALE, raw_connect, read_http_response
from loopback import ALLOW_LOOPBACK, LoopbackServer, send_file

FIXTURES = REPO / "tests" / "fixtures"
MLP = (FIXTURES / "mlp.pt").read_bytes()
CNN = (FIXTURES / "cnn.pt").read_bytes()
NOT_A_MODEL = (FIXTURES / "not_a_model.pt").read_bytes()
ZIP_NOT_TS = (FIXTURES / "zip_not_torchscript.pt").read_bytes()
BIG_PATH = REPO / "examples" / "fashion_mnist" / "model.pt"
BIG = BIG_PATH.read_bytes()

MLP_CONFIG = {"input": {"shape": [4], "dtype": "float32"}, "output": "logits"}


def sha(data):
    return hashlib.sha256(data).hexdigest()


# ---------------------------------------------------------------- helpers


def error_code(resp):
    ctype = resp.headers.get("Content-Type", "")
    assert ctype.split(";")[0].strip() == "application/json", \
        f"error with Content-Type {ctype!r}: {resp.status_code} {resp.text!r}"
    body = resp.json()
    assert isinstance(body, dict) and isinstance(body.get("error"), dict), \
        f"not a JSON error body: {resp.text!r}"
    assert isinstance(body["error"].get("message"), str) and body["error"]["message"], resp.text
    return body["error"]["code"]


def expect_error(resp, status, code=None):
    assert resp.status_code == status, \
        f"expected {status} {code}, got {resp.status_code}: {resp.text!r}"
    got = error_code(resp)
    if code is not None:
        assert got == code, f"expected code {code}, got {got}: {resp.text!r}"
    return resp.json()["error"]


def upload(srv, name, data=MLP, filename="model.pt", config=None, metrics=None, **fields):
    """Multipart upload, as curl -F checkpoint=@model.pt -F config=... does."""
    form = {}
    if config is not None:
        form["config"] = json.dumps(config)
    if metrics is not None:
        form["metrics"] = json.dumps(metrics)
    for k, v in fields.items():
        form[k] = v if isinstance(v, str) else json.dumps(v)
    return srv.request("POST", f"/models/{name}/versions", data=form,
                       files={"checkpoint": (filename, data, "application/octet-stream")},
                       timeout=30 * TSCALE)


def upload_raw(srv, name, data=MLP, content_type="application/octet-stream", **query):
    params = {k: (v if isinstance(v, str) else json.dumps(v)) for k, v in query.items()}
    headers = {"Content-Type": content_type} if content_type else {}
    return srv.request("POST", f"/models/{name}/versions", params=params, data=data,
                       headers=headers, timeout=30 * TSCALE)


def created(resp):
    assert resp.status_code == 201, f"expected 201, got {resp.status_code}: {resp.text!r}"
    return resp.json()


def blob_names(srv):
    d = srv.store / "blobs"
    return sorted(p.name for p in d.iterdir()) if d.is_dir() else []


def tmp_names(srv):
    d = srv.store / "tmp"
    return sorted(p.name for p in d.iterdir()) if d.is_dir() else []


def wait_tmp_empty(srv, timeout=3.0):
    """The temp file of a refused upload goes when the request is freed, which
    may be just after the reply reaches the client: allow a moment."""
    deadline = time.monotonic() + timeout * TSCALE
    while tmp_names(srv) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert tmp_names(srv) == [], f"temp files left in {srv.store / 'tmp'}: {tmp_names(srv)}"


def versions_of(srv, name):
    r = srv.get(f"/models/{name}")
    assert r.status_code == 200, r.text
    return [v["version"] for v in r.json()["versions"]]


def model(srv, name):
    r = srv.get(f"/models/{name}")
    assert r.status_code == 200, r.text
    return r.json()


# ---------------------------------------------------------------- a file server


class FileServer(LoopbackServer):
    """Serves tests/fixtures (and the same files under /ok/); counts GETs per
    path; sleeps `delay` seconds between the headers and the body."""

    def __init__(self):
        self.delay = 0.0
        super().__init__(self._respond)

    def _respond(self, h):
        rel = h.path.split("?", 1)[0]
        if rel.startswith("/ok/"):
            rel = rel[3:]
        delay = self.delay
        send_file(h, FIXTURES, rel, (lambda: time.sleep(delay)) if delay else None)

    def set_delay(self, seconds):
        self.delay = seconds


@pytest.fixture
def files():
    fs = FileServer()
    yield fs
    fs.close()


# FileServer listens on 127.0.0.1, which downloads refuse unless allowed:
# ALLOW_LOOPBACK (loopback.py)


@pytest.fixture
def url_server(start_server):
    return start_server(*ALLOW_LOOPBACK)


def register(srv, body):
    return srv.request("POST", "/models", json=body, timeout=30 * TSCALE)


# ---------------------------------------------------------------- uploads


def test_multipart_upload_then_raw_upload_of_same_bytes(server):
    r = upload(server, "mlp", MLP, config=MLP_CONFIG, metrics={"loss": 0.25, "epoch": 3})
    v = created(r)
    assert v["model"] == "mlp"
    assert v["version"] == 1
    assert v["sha256"] == sha(MLP)
    assert v["size"] == len(MLP)
    assert v["metrics"] == {"loss": 0.25, "epoch": 3}
    assert v["config"] == MLP_CONFIG
    assert v["default"] is True
    assert v["source"] == "upload"
    assert r.headers.get("Location") == "/models/mlp/versions/1"
    blob = server.store / "blobs" / sha(MLP)
    assert blob.is_file(), f"no blob at {blob}; blobs: {blob_names(server)}"
    assert blob.read_bytes() == MLP

    r = upload_raw(server, "mlp", MLP, make_default="false", metrics={"loss": 0.5})
    v2 = created(r)
    assert v2["version"] == 2
    assert v2["sha256"] == sha(MLP)
    assert v2["metrics"] == {"loss": 0.5}
    assert v2["default"] is False
    assert r.headers.get("Location") == "/models/mlp/versions/2"
    m = model(server, "mlp")
    assert m["default_version"] == 1
    assert [x["version"] for x in m["versions"]] == [1, 2]
    assert [x["default"] for x in m["versions"]] == [True, False]
    # the same bytes are stored once
    assert blob_names(server) == [sha(MLP)]
    assert tmp_names(server) == []


def test_explicit_version_and_conflict(server):
    v = created(upload(server, "m", MLP, version="7"))
    assert v["version"] == 7
    assert server.get("/models/m/versions/7").status_code == 200
    before_blobs = blob_names(server)
    # same number again, with other bytes: 409 and nothing of it kept
    expect_error(upload(server, "m", CNN, version="7"), 409, "version_exists")
    assert versions_of(server, "m") == [7]
    assert server.get("/models/m/versions/7").json()["sha256"] == sha(MLP)
    assert blob_names(server) == before_blobs
    wait_tmp_empty(server)
    # raw upload with the number as a query argument: same answer
    expect_error(upload_raw(server, "m", CNN, version="7"), 409, "version_exists")
    assert blob_names(server) == before_blobs
    wait_tmp_empty(server)
    # without a number: the next one after the highest
    assert created(upload(server, "m", CNN))["version"] == 8
    assert sorted(blob_names(server)) == sorted([sha(MLP), sha(CNN)])


def test_deploy_false_does_not_move_default(server):
    created(upload(server, "d", MLP))
    v = created(upload(server, "d", CNN, deploy="false"))
    assert v["version"] == 2
    assert v["default"] is False
    m = model(server, "d")
    assert m["default_version"] == 1
    r = upload_raw(server, "d", CNN, deploy="false")
    assert created(r)["default"] is False
    assert model(server, "d")["default_version"] == 1
    # and the default does move without it
    assert created(upload(server, "d", MLP))["default"] is True
    assert model(server, "d")["default_version"] == 4


# ---------------------------------------------------------------- errors store nothing


def _case_empty_raw(s, name):
    return upload_raw(s, name, b""), 400, "empty_checkpoint"


def _case_not_archive(s, name):
    return upload(s, name, NOT_A_MODEL), 422, "invalid_checkpoint"


def _case_not_archive_raw(s, name):
    return upload_raw(s, name, NOT_A_MODEL), 422, "invalid_checkpoint"


def _case_zip_not_torchscript(s, name):
    return upload(s, name, ZIP_NOT_TS), 422, "invalid_checkpoint"


def _case_wrong_sha_multipart(s, name):
    return upload(s, name, MLP, sha256=sha(CNN)), 400, "sha256_mismatch"


def _case_wrong_sha_raw(s, name):
    return upload_raw(s, name, MLP, sha256=sha(CNN)), 400, "sha256_mismatch"


def _case_unknown_config_key(s, name):
    r = upload(s, name, MLP, config={"input": {"shape": [4]}, "bogus_key": 1})
    return r, 422, "invalid_config"


def _case_unknown_config_key_after_file(s, name):
    # curl -F checkpoint=@f -F config=...: the text field arrives after the bytes
    r = s.request("POST", f"/models/{name}/versions", timeout=30 * TSCALE,
                  files=[("checkpoint", ("m.pt", MLP, "application/octet-stream")),
                         ("config", (None, json.dumps({"bogus_key": 1})))])
    return r, 422, "invalid_config"


def _case_metrics_not_object(s, name):
    return upload(s, name, MLP, metrics=[0.1, 0.2]), 400, None


def _case_metrics_not_number(s, name):
    return upload(s, name, MLP, metrics={"loss": "low"}), 400, None


def _case_unknown_field(s, name):
    return upload(s, name, MLP, colour="blue"), 400, "unknown_field"


def _case_unknown_field_after_file(s, name):
    r = s.request("POST", f"/models/{name}/versions", timeout=30 * TSCALE,
                  files=[("checkpoint", ("m.pt", MLP, "application/octet-stream")),
                         ("colour", (None, "blue"))])
    return r, 400, "unknown_field"


def _case_wrong_content_type(s, name):
    return upload_raw(s, name, MLP, content_type="text/plain"), 415, None


def _case_bad_version(s, name):
    return upload(s, name, MLP, version="0"), 400, None


def _case_multipart_without_checkpoint(s, name):
    r = s.request("POST", f"/models/{name}/versions", timeout=30 * TSCALE,
                  files=[("config", (None, json.dumps(MLP_CONFIG)))])
    return r, 400, None


ERROR_CASES = [
    _case_empty_raw, _case_not_archive, _case_not_archive_raw, _case_zip_not_torchscript,
    _case_wrong_sha_multipart, _case_wrong_sha_raw, _case_unknown_config_key,
    _case_unknown_config_key_after_file, _case_metrics_not_object, _case_metrics_not_number,
    _case_unknown_field, _case_unknown_field_after_file, _case_wrong_content_type,
    _case_bad_version, _case_multipart_without_checkpoint,
]


@pytest.mark.parametrize("case", ERROR_CASES, ids=[c.__name__[6:] for c in ERROR_CASES])
def test_refused_upload_stores_nothing(server, case):
    # an existing model: the refused upload adds no version to it
    created(upload(server, "keep", CNN))
    blobs_before = blob_names(server)
    resp, status, code = case(server, "keep")
    err = expect_error(resp, status, code)
    if case is _case_unknown_config_key or case is _case_unknown_config_key_after_file:
        assert "bogus_key" in err["message"], err
    assert versions_of(server, "keep") == [1]
    assert blob_names(server) == blobs_before
    wait_tmp_empty(server)
    # a new model: no row at all
    resp, status, code = case(server, "fresh")
    expect_error(resp, status, code)
    expect_error(server.get("/models/fresh"), 404, "model_not_found")
    assert [m["name"] for m in server.get("/models").json()["models"]] == ["keep"]
    assert blob_names(server) == blobs_before
    wait_tmp_empty(server)


@pytest.mark.parametrize("name", ["bad name", "a" * 65, "caf%C3%A9", "semi;colon"])
def test_invalid_name_refused(server, name):
    expect_error(upload(server, name, MLP), 400, "invalid_name")
    expect_error(upload_raw(server, name, MLP), 400, "invalid_name")
    expect_error(register(server, {"name": requests.utils.unquote(name),
                                   "source": "http://127.0.0.1:1/x.pt"}), 400, "invalid_name")
    assert server.get("/models").json()["models"] == []
    assert blob_names(server) == []
    wait_tmp_empty(server)


def test_name_of_64_chars_is_fine(server):
    name = "A-z_0.9" + "x" * 57
    assert len(name) == 64
    assert created(upload(server, name, MLP))["model"] == name


def test_checkpoint_over_max_checkpoint_bytes(start_server):
    s = start_server("--max-checkpoint-bytes", "1000")
    assert len(MLP) > 1000
    # with Content-Length: refused from the headers
    expect_error(upload(s, "big", MLP), 413)
    expect_error(upload_raw(s, "big", MLP), 413)

    # chunked, no length known in advance: refused once the limit is passed
    def chunks():
        for i in range(0, len(MLP), 512):
            yield MLP[i:i + 512]

    r = s.request("POST", "/models/big/versions", data=chunks(),
                  headers={"Content-Type": "application/octet-stream"}, timeout=30 * TSCALE)
    expect_error(r, 413)
    expect_error(s.get("/models/big"), 404, "model_not_found")
    assert blob_names(s) == []
    wait_tmp_empty(s)


# ---------------------------------------------------------------- register from a URL


def test_register_from_http_url(url_server, files):
    server = url_server
    url = files.url("/cnn.pt")
    r = register(server, {"name": "cnn", "source": url, "sha256": sha(CNN),
                          "metrics": {"loss": 0.4}})
    v = created(r)
    assert v["version"] == 1
    assert v["sha256"] == sha(CNN)
    assert v["size"] == len(CNN)
    assert v["source"] == url
    assert v["default"] is True
    assert v["metrics"] == {"loss": 0.4}
    assert r.headers.get("Location") == "/models/cnn/versions/1"
    assert (server.store / "blobs" / sha(CNN)).read_bytes() == CNN
    assert files.gets("/cnn.pt") == 1
    # without a sha256 it works too
    v = created(register(server, {"name": "cnn", "source": files.url("/mlp.pt")}))
    assert v["version"] == 2 and v["sha256"] == sha(MLP)
    wait_tmp_empty(server)


def test_register_wrong_sha256_stores_nothing(url_server, files):
    server = url_server
    r = register(server, {"name": "cnn", "source": files.url("/cnn.pt"), "sha256": sha(MLP)})
    expect_error(r, 400, "sha256_mismatch")
    expect_error(server.get("/models/cnn"), 404, "model_not_found")
    assert blob_names(server) == []
    wait_tmp_empty(server)
    # an existing model gets no new row either
    created(register(server, {"name": "cnn", "source": files.url("/cnn.pt")}))
    r = register(server, {"name": "cnn", "source": files.url("/mlp.pt"), "sha256": sha(CNN)})
    expect_error(r, 400, "sha256_mismatch")
    assert versions_of(server, "cnn") == [1]
    assert blob_names(server) == [sha(CNN)]
    wait_tmp_empty(server)


def test_register_download_errors(url_server, files):
    server = url_server
    expect_error(register(server, {"name": "x", "source": files.url("/nope.pt")}), 422,
                 "download_failed")
    # not a TorchScript archive, fetched fine
    expect_error(register(server, {"name": "x", "source": files.url("/not_a_model.pt")}), 422,
                 "invalid_checkpoint")
    expect_error(register(server, {"name": "x", "source": files.url("/zip_not_torchscript.pt")}),
                 422, "invalid_checkpoint")
    expect_error(register(server, {"name": "x", "source": "ftp://127.0.0.1/cnn.pt"}), 400)
    expect_error(register(server, {"name": "x"}), 400)
    expect_error(register(server, {"source": files.url("/cnn.pt")}), 400)
    expect_error(register(server, {"name": "x", "source": files.url("/cnn.pt"), "colour": 1}),
                 400, "unknown_field")
    expect_error(server.get("/models/x"), 404, "model_not_found")
    assert blob_names(server) == []
    wait_tmp_empty(server)


def test_register_too_large_download(start_server, files):
    s = start_server("--max-checkpoint-bytes", "1000", *ALLOW_LOOPBACK)
    expect_error(register(s, {"name": "x", "source": files.url("/cnn.pt")}), 413)
    expect_error(s.get("/models/x"), 404, "model_not_found")
    assert blob_names(s) == []
    wait_tmp_empty(s)


def test_register_file_url_allowed_paths(start_server):
    s = start_server("--allowed-paths", str(FIXTURES))
    url = f"file://{FIXTURES}/mlp.pt"
    v = created(register(s, {"name": "f", "source": url, "sha256": sha(MLP)}))
    assert v["sha256"] == sha(MLP) and v["source"] == url
    assert (s.store / "blobs" / sha(MLP)).read_bytes() == MLP
    # outside allowed_paths
    r = register(s, {"name": "g", "source": f"file://{BIG_PATH}"})
    expect_error(r, 400, "source_not_allowed")
    # a path that climbs out with ..
    r = register(s, {"name": "g", "source": f"file://{FIXTURES}/../../examples/fashion_mnist/"
                                            "model.pt"})
    expect_error(r, 400, "source_not_allowed")
    expect_error(s.get("/models/g"), 404, "model_not_found")
    assert blob_names(s) == [sha(MLP)]
    wait_tmp_empty(s)


def test_register_file_url_without_allowed_paths(server):
    r = register(server, {"name": "f", "source": f"file://{FIXTURES}/mlp.pt"})
    expect_error(r, 400, "source_not_allowed")
    expect_error(server.get("/models/f"), 404, "model_not_found")
    assert blob_names(server) == []


def test_register_allowed_urls(start_server, files):
    s = start_server("--allowed-urls", files.url("/ok/"), *ALLOW_LOOPBACK)
    expect_error(register(s, {"name": "u", "source": files.url("/cnn.pt")}), 400,
                 "source_not_allowed")
    assert files.gets("/cnn.pt") == 0, "a refused source must not be fetched"
    v = created(register(s, {"name": "u", "source": files.url("/ok/cnn.pt")}))
    assert v["sha256"] == sha(CNN)
    assert versions_of(s, "u") == [1]


def test_concurrent_registrations_download_once(url_server, files):
    server = url_server
    files.set_delay(0.5)
    url = files.url("/cnn.pt")
    results = {}

    def go(i):
        try:
            results[i] = register(server, {"name": f"c{i}", "source": url})
        except Exception as e:  # reported below
            results[i] = e

    threads = [threading.Thread(target=go, args=(i,)) for i in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60 * TSCALE)
    for i in range(5):
        r = results.get(i)
        assert isinstance(r, requests.Response), f"request {i}: {r!r}"
        v = created(r)
        assert v["model"] == f"c{i}" and v["sha256"] == sha(CNN) and v["version"] == 1
    assert files.gets("/cnn.pt") == 1, \
        f"the source was downloaded {files.gets('/cnn.pt')} times for 5 concurrent registrations"
    assert blob_names(server) == [sha(CNN)]
    wait_tmp_empty(server)
    names = [m["name"] for m in server.get("/models").json()["models"]]
    assert names == [f"c{i}" for i in range(5)]


# ---------------------------------------------------------------- reading


def test_list_models_paginates(server):
    for name in ("beta", "alpha", "gamma"):
        created(upload(server, name, MLP))
    r = server.get("/models", params={"limit": 2})
    assert r.status_code == 200, r.text
    page = r.json()
    assert [m["name"] for m in page["models"]] == ["alpha", "beta"]
    assert page["next"] == "beta"
    assert page["models"][0]["default_version"] == 1
    r = server.get("/models", params={"limit": 2, "after": page["next"]})
    page2 = r.json()
    assert [m["name"] for m in page2["models"]] == ["gamma"]
    assert page2["next"] is None
    assert [m["name"] for m in server.get("/models").json()["models"]] == \
        ["alpha", "beta", "gamma"]
    expect_error(server.get("/models", params={"limit": 0}), 400)
    expect_error(server.get("/models", params={"limit": "x"}), 400)


def test_get_model_version_and_checkpoint(server):
    created(upload(server, "m", MLP, config=MLP_CONFIG, metrics={"loss": 1.5}))
    # another architecture: an explicit (empty) config, or it would inherit the MLP's
    created(upload(server, "m", CNN, config={}, metadata={"by": "test"}))
    m = model(server, "m")
    assert m["name"] == "m"
    assert m["default_version"] == 2
    assert [v["version"] for v in m["versions"]] == [1, 2]
    assert [v["sha256"] for v in m["versions"]] == [sha(MLP), sha(CNN)]

    r = server.get("/models/m/versions/1")
    assert r.status_code == 200, r.text
    v1 = r.json()
    assert v1["version"] == 1 and v1["config"] == MLP_CONFIG and v1["metrics"] == {"loss": 1.5}
    assert v1["default"] is False and v1["size"] == len(MLP)
    assert server.get("/models/m/versions/2").json()["metadata"] == {"by": "test"}

    expect_error(server.get("/models/nope"), 404, "model_not_found")
    expect_error(server.get("/models/nope/versions/1"), 404, "model_not_found")
    expect_error(server.get("/models/m/versions/9"), 404, "version_not_found")
    expect_error(server.get("/models/m/versions/9/checkpoint"), 404, "version_not_found")
    expect_error(server.get("/models/nope/versions/1/checkpoint"), 404, "model_not_found")
    expect_error(server.get("/models/m/versions/abc"), 400)

    for ver, data in ((1, MLP), (2, CNN)):
        r = server.get(f"/models/m/versions/{ver}/checkpoint")
        assert r.status_code == 200, r.text
        assert r.content == data
        assert r.headers.get("ETag") == f'"{sha(data)}"'
        r = server.get(f"/models/m/versions/{ver}/checkpoint",
                       headers={"If-None-Match": f'"{sha(data)}"'})
        assert r.status_code == 304, r.text
        assert r.content == b""
        r = server.get(f"/models/m/versions/{ver}/checkpoint",
                       headers={"If-None-Match": '"0000"'})
        assert r.status_code == 200 and r.content == data


def test_versions_ordered_by_metric(server):
    losses = {1: 0.5, 2: 0.2, 3: 0.9, 4: 0.35}
    for ver in sorted(losses):
        created(upload(server, "m", MLP, metrics={"loss": losses[ver], "acc": 1 - losses[ver]}))
    created(upload(server, "m", MLP))  # version 5: no loss at all
    r = server.get("/models/m/versions", params={"order_by": "metrics.loss", "order": "asc"})
    assert r.status_code == 200, r.text
    got = [v["version"] for v in r.json()["versions"]]
    assert got[:4] == [2, 4, 1, 3], got
    assert sorted(got) == [1, 2, 3, 4, 5]
    r = server.get("/models/m/versions", params={"order_by": "metrics.loss", "order": "desc"})
    assert [v["version"] for v in r.json()["versions"]][:4] == [3, 1, 4, 2]
    r = server.get("/models/m/versions", params={"order_by": "metrics.acc", "order": "desc"})
    assert [v["version"] for v in r.json()["versions"]][:4] == [2, 4, 1, 3]
    r = server.get("/models/m/versions")
    assert [v["version"] for v in r.json()["versions"]] == [1, 2, 3, 4, 5]
    expect_error(server.get("/models/m/versions", params={"order_by": "size"}), 400)
    expect_error(server.get("/models/m/versions", params={"order_by": "metrics.a b"}), 400)
    expect_error(server.get("/models/m/versions", params={"order_by": "metrics.x') --"}), 400)
    expect_error(server.get("/models/m/versions", params={"order": "up"}), 400)
    expect_error(server.get("/models/nope/versions"), 404, "model_not_found")
    # a metric no version has is a typo, not a sort key: 400 with what there is
    err = expect_error(server.get("/models/m/versions", params={"order_by": "metrics.los"}), 400,
                       "unknown_metric")
    assert "loss, acc" in err["message"] and "did you mean metrics.loss?" in err["message"], err


def test_model_name_typo_suggests_the_nearest(server):
    created(upload(server, "fashion", MLP, config=MLP_CONFIG))
    for path, kw in (("/models/fashon", {}), ("/models/fashon/versions", {}),
                     ("/models/Fashion/versions/1", {})):
        err = expect_error(server.get(path, **kw), 404, "model_not_found")
        assert "did you mean fashion?" in err["message"], (path, err)
    r = server.request("POST", "/models/fashoin/predict", data="[[1, 2, 3, 4]]")
    err = expect_error(r, 404, "model_not_found")
    assert "did you mean fashion?" in err["message"], err
    err = expect_error(server.get("/models/resnet"), 404, "model_not_found")
    assert "did you mean" not in err["message"], err


# ---------------------------------------------------------------- changing and deleting


def test_patch_default_and_delete(server):
    for data in (MLP, MLP, CNN):
        created(upload(server, "m", data))
    assert model(server, "m")["default_version"] == 3
    # roll back, then forward
    r = server.request("PATCH", "/models/m", json={"default_version": 1})
    assert r.status_code == 200, r.text
    assert r.json()["default_version"] == 1
    assert model(server, "m")["default_version"] == 1
    assert server.get("/models/m/versions/1").json()["default"] is True
    r = server.request("PATCH", "/models/m", json={"default_version": 3})
    assert r.status_code == 200 and r.json()["default_version"] == 3
    expect_error(server.request("PATCH", "/models/m", json={"default_version": 9}), 404,
                 "version_not_found")
    expect_error(server.request("PATCH", "/models/m", json={"colour": "red"}), 400,
                 "unknown_field")
    expect_error(server.request("PATCH", "/models/m", json={}), 400)
    expect_error(server.request("PATCH", "/models/m", json={"default_version": "2"}), 400)
    expect_error(server.request("PATCH", "/models/nope", json={"default_version": 1}), 404,
                 "model_not_found")
    assert model(server, "m")["default_version"] == 3

    # the default cannot go while others exist, unless forced
    expect_error(server.request("DELETE", "/models/m/versions/3"), 409, "version_is_default")
    assert versions_of(server, "m") == [1, 2, 3]
    r = server.request("DELETE", "/models/m/versions/3", params={"force": "true"})
    assert r.status_code == 200, r.text
    assert versions_of(server, "m") == [1, 2]
    assert model(server, "m")["default_version"] == 2
    # the CNN bytes were used by version 3 only
    assert blob_names(server) == [sha(MLP)]

    # versions 1 and 2 share the MLP bytes: the blob stays until both are gone
    r = server.request("DELETE", "/models/m/versions/1")
    assert r.status_code == 200, r.text
    assert blob_names(server) == [sha(MLP)]
    expect_error(server.request("DELETE", "/models/m/versions/1"), 404, "version_not_found")
    # the last version may go even though it is the default
    r = server.request("DELETE", "/models/m/versions/2")
    assert r.status_code == 200, r.text
    assert blob_names(server) == []
    m = model(server, "m")
    assert m["versions"] == [] and m["default_version"] is None


def test_delete_model_removes_rows_and_blobs(server):
    created(upload(server, "a", MLP))
    created(upload(server, "a", CNN))
    created(upload(server, "b", MLP))
    r = server.request("DELETE", "/models/a")
    assert r.status_code == 200, r.text
    expect_error(server.get("/models/a"), 404, "model_not_found")
    expect_error(server.get("/models/a/versions/1"), 404, "model_not_found")
    # MLP is still used by b; CNN was a's alone
    assert blob_names(server) == [sha(MLP)]
    assert [m["name"] for m in server.get("/models").json()["models"]] == ["b"]
    expect_error(server.request("DELETE", "/models/a"), 404, "model_not_found")
    r = server.request("DELETE", "/models/b")
    assert r.status_code == 200, r.text
    assert blob_names(server) == []
    # the name can be used again, starting at version 1
    assert created(upload(server, "a", CNN))["version"] == 1


# ---------------------------------------------------------------- retention


def test_retention_keep_last(server):
    created(upload(server, "r", MLP))  # version 1: the default
    r = server.request("PATCH", "/models/r", json={"retention": {"keep_last": 2}})
    assert r.status_code == 200, r.text
    assert r.json()["retention"] == {"keep_last": 2}
    for data in (CNN, BIG, MLP, CNN):  # versions 2..5
        created(upload(server, "r", data, make_default="false"))
    # the newest two, plus the default
    assert versions_of(server, "r") == [1, 4, 5]
    assert model(server, "r")["default_version"] == 1
    # BIG was version 3's alone: its blob went with it
    assert sorted(blob_names(server)) == sorted([sha(MLP), sha(CNN)])
    wait_tmp_empty(server)
    # with the default moving, only the newest two remain
    created(upload(server, "r", BIG))  # version 6, default
    assert versions_of(server, "r") == [5, 6]
    assert model(server, "r")["default_version"] == 6
    assert sorted(blob_names(server)) == sorted([sha(CNN), sha(BIG)])


def test_retention_same_bytes_counts_rows(server):
    created(upload(server, "s", MLP))
    created(upload(server, "s", MLP, retention={"keep_last": 2}))
    for _ in range(4):
        created(upload_raw(server, "s", MLP))
    assert versions_of(server, "s") == [5, 6]
    assert blob_names(server) == [sha(MLP)]


def test_retention_keep_best(server):
    created(upload(server, "b", MLP, metrics={"loss": 0.5}))  # version 1: the default
    policy = {"keep_best": 2, "metric": "metrics.loss", "order": "asc"}
    r = server.request("PATCH", "/models/b", json={"retention": policy})
    assert r.status_code == 200, r.text
    for loss in (0.3, 0.9, 0.1, 0.7):
        r = upload(server, "b", MLP, metrics={"loss": loss}, make_default="false")
        # 0.9 and 0.7 are pruned by the policy in the very transaction that adds
        # them; the upload itself was accepted and must not answer 5xx
        assert r.status_code < 500, f"upload with loss {loss}: {r.status_code} {r.text!r}"
        if r.status_code == 201:
            v = r.json()
            assert v["metrics"] == {"loss": loss}, r.text
            assert r.headers.get("Location") == f"/models/b/versions/{v['version']}"
    # the two lowest losses (0.1, 0.3), plus the default (0.5)
    m = model(server, "b")
    assert sorted(v["metrics"]["loss"] for v in m["versions"]) == [0.1, 0.3, 0.5], m
    assert m["default_version"] == 1
    assert server.get("/models/b/versions/1").json()["metrics"] == {"loss": 0.5}
    # a policy keeping the highest instead, applied at once: the best two by desc
    # (0.5 and 0.3) and the default (0.5) remain
    policy = {"keep_best": 2, "metric": "metrics.loss", "order": "desc"}
    r = server.request("PATCH", "/models/b", json={"retention": policy})
    assert r.status_code == 200, r.text
    m = model(server, "b")
    assert sorted(v["metrics"]["loss"] for v in m["versions"]) == [0.3, 0.5], m


def test_retention_applied_at_once_and_default_kept(server):
    for _ in range(4):
        created(upload(server, "n", MLP, make_default="false"))
    # version 1 stays the default (the first version is the default)
    assert model(server, "n")["default_version"] == 1
    r = server.request("PATCH", "/models/n", json={"retention": {"keep_last": 1}})
    assert r.status_code == 200, r.text
    assert versions_of(server, "n") == [1, 4]
    expect_error(server.request("PATCH", "/models/n", json={"retention": {"keep_last": 0}}), 400)
    expect_error(server.request("PATCH", "/models/n", json={"retention": {"keep_best": 2}}), 400)
    expect_error(server.request("PATCH", "/models/n", json={"retention": {"bogus": 2}}), 400)
    r = server.request("PATCH", "/models/n", json={"retention": None})
    assert r.status_code == 200, r.text
    assert r.json()["retention"] is None
    for _ in range(3):
        created(upload(server, "n", MLP, make_default="false"))
    assert versions_of(server, "n") == [1, 4, 5, 6, 7]


# ---------------------------------------------------------------- restarts


def test_restart_keeps_every_version(start_server):
    s = start_server()
    created(upload(s, "a", MLP, config=MLP_CONFIG, metrics={"loss": 0.2}))
    created(upload(s, "a", CNN, config={}, make_default="false"))  # not the MLP's config
    created(upload(s, "b", BIG))
    before = {n: model(s, n) for n in ("a", "b")}
    assert s.stop() == 0, s.stderr
    s2 = start_server()
    for n in ("a", "b"):
        after = model(s2, n)
        assert after["default_version"] == before[n]["default_version"]
        assert [(v["version"], v["sha256"], v["size"], v["config"], v["metrics"])
                for v in after["versions"]] == \
            [(v["version"], v["sha256"], v["size"], v["config"], v["metrics"])
             for v in before[n]["versions"]]
    r = s2.get("/models/b/versions/1/checkpoint")
    assert r.status_code == 200 and r.content == BIG
    assert sorted(blob_names(s2)) == sorted([sha(MLP), sha(CNN), sha(BIG)])
    # numbering goes on
    assert created(upload(s2, "a", MLP))["version"] == 3


def test_missing_blob_marks_version_failed(start_server):
    s = start_server()
    created(upload(s, "m", MLP))
    created(upload(s, "m", CNN, make_default="false"))
    assert s.stop() == 0, s.stderr
    (s.store / "blobs" / sha(CNN)).unlink()
    s2 = start_server()
    assert s2.get("/healthz").status_code == 200
    v2 = s2.get("/models/m/versions/2").json()
    assert v2["state"] == "failed", v2
    assert "missing" in v2.get("state_reason", ""), v2
    v1 = s2.get("/models/m/versions/1").json()
    assert v1["state"] != "failed", v1
    # a failed version cannot become the default
    r = s2.request("PATCH", "/models/m", json={"default_version": 2})
    assert r.status_code == 409, r.text
    # uploading the bytes again as a new version works
    assert created(upload(s2, "m", CNN))["version"] == 3
    # and another restart keeps the failed one failed, not revived
    assert s2.stop() == 0, s2.stderr
    s3 = start_server()
    assert s3.get("/models/m/versions/2").json()["state"] == "failed"


def test_kill_9_during_upload_leaves_nothing(start_server):
    s = start_server()
    created(upload(s, "other", MLP))
    total = 5 * 1024 * 1024
    chunk = os.urandom(64 * 1024)
    sock = raw_connect(s.port)
    try:
        sock.sendall((f"POST /models/killme/versions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                      f"Content-Type: application/octet-stream\r\n"
                      f"Content-Length: {total}\r\n\r\n").encode())
        sent = 0
        while sent < 2 * 1024 * 1024:
            sock.sendall(chunk)
            sent += len(chunk)
            time.sleep(0.01)
        # the upload is streaming into tmp/
        deadline = time.monotonic() + 5 * TSCALE
        while not tmp_names(s) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert tmp_names(s), "no temp file while an upload streams"
        assert s.stop(signal.SIGKILL) == -signal.SIGKILL
    finally:
        sock.close()
    assert tmp_names(s), "the killed server's temp file should still be there before restart"
    s2 = start_server()
    assert tmp_names(s2) == [], f"temp files left after restart: {tmp_names(s2)}"
    expect_error(s2.get("/models/killme"), 404, "model_not_found")
    assert blob_names(s2) == [sha(MLP)]
    assert versions_of(s2, "other") == [1]


def test_slow_upload_survives_sigterm(start_server):
    s = start_server(drain_seconds=1)
    n_chunks = 30
    step = -(-len(BIG) // n_chunks)
    sock = raw_connect(s.port, timeout=30)
    try:
        sock.sendall((f"POST /models/slow/versions?metrics=%7B%22loss%22%3A0.3%7D HTTP/1.1\r\n"
                      f"Host: 127.0.0.1\r\nContent-Type: application/octet-stream\r\n"
                      f"Content-Length: {len(BIG)}\r\n\r\n").encode())
        sock.sendall(BIG[:step])
        time.sleep(0.1)
        s.send_signal(signal.SIGTERM)
        for i in range(step, len(BIG), step):  # the rest over about 3 s
            time.sleep(0.1)
            sock.sendall(BIG[i:i + step])
        resp = read_http_response(sock, timeout=30)
    finally:
        sock.close()
    assert resp.status == 201, f"{resp.status}: {resp.body!r}; stderr:\n{s.stderr}"
    v = resp.json()
    assert v["version"] == 1 and v["sha256"] == sha(BIG) and v["size"] == len(BIG)
    rc = s.proc.wait(20 * TSCALE)
    assert rc == 0, f"exit {rc}; stderr:\n{s.stderr}"
    s2 = start_server()
    v = s2.get("/models/slow/versions/1").json()
    assert v["sha256"] == sha(BIG) and v["metrics"] == {"loss": 0.3}
    assert (s2.store / "blobs" / sha(BIG)).read_bytes() == BIG
    assert tmp_names(s2) == []
