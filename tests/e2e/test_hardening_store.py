"""
test_hardening_store.py - the store and the models handler under the inputs
and interleavings issue 10 (items 7, 8, 10, 11, 13) and issue 9 (item 4)
found wrong, against the real binary:

- a version uploaded without config inherits the current default's config
  (multipart, raw and URL registration) and says so with "config_from"; an
  explicit config replaces it;
- a deployment field given twice is refused with 400 naming it, and nothing
  leaks (under the ASan build, ASAN_E2E=1, LeakSanitizer reports at exit);
- concurrent registrations of one URL share only the download: each checks
  its own sha256 and config. The file server holds the body until the test
  has seen, in the server log, that the second request joined the download,
  so the interleaving does not depend on the machine's speed.
"""
import hashlib
import json
import os
import threading
import time

import pytest
import requests

from conftest import REPO, TSCALE
from loopback import LoopbackServer, send_file

FIXTURES = REPO / "tests" / "fixtures"
MLP = (FIXTURES / "mlp.pt").read_bytes()
CNN = (FIXTURES / "cnn.pt").read_bytes()
MLP_INPUT = json.loads((FIXTURES / "mlp_input.json").read_text())
LABELED = {"input": {"shape": [4], "dtype": "float32"}, "output": "probabilities",
           "labels": ["cat", "dog", "eel"]}
ASAN = os.environ.get("ASAN_E2E") == "1"


def sha(data):
    return hashlib.sha256(data).hexdigest()


def expect_error(resp, status, code):
    assert resp.status_code == status, \
        f"expected {status} {code}, got {resp.status_code}: {resp.text!r}"
    err = resp.json()["error"]
    assert err["code"] == code, f"expected code {code}: {resp.text!r}"
    return err["message"]


def created(resp):
    assert resp.status_code == 201, f"expected 201, got {resp.status_code}: {resp.text!r}"
    return resp.json()


def upload(srv, name, data=MLP, fields=(), params=None):
    return srv.request("POST", f"/models/{name}/versions", data=list(fields), params=params,
                       files={"checkpoint": ("model.pt", data, "application/octet-stream")},
                       timeout=30 * TSCALE)


def upload_raw(srv, name, data=MLP, **query):
    params = {k: (v if isinstance(v, str) else json.dumps(v)) for k, v in query.items()}
    return srv.request("POST", f"/models/{name}/versions", params=params, data=data,
                       headers={"Content-Type": "application/octet-stream"},
                       timeout=30 * TSCALE)


def register(srv, body):
    return srv.request("POST", "/models", json=body, timeout=60 * TSCALE)


def predict(srv, name, version=None):
    path = f"/models/{name}" + (f"/versions/{version}" if version else "") + "/predict"
    r = srv.request("POST", path, json=MLP_INPUT[:2], timeout=30 * TSCALE)
    assert r.status_code == 200, r.text
    return r.json()


def stop_clean(srv):
    """Stop the server; under ASan its exit must be clean (LSan reports leaks at exit)."""
    rc = srv.stop()
    if ASAN:
        assert "LeakSanitizer" not in srv.stderr and "AddressSanitizer" not in srv.stderr, \
            srv.stderr[-6000:]
        assert rc == 0, f"exit {rc}: {srv.stderr[-3000:]}"


# ------------------------------------------------------- a gated file server


class GatedServer(LoopbackServer):
    """Serves tests/fixtures; counts GETs; sends each body only once `gate`
    is set; `arrived` is set by the first GET."""

    def __init__(self):
        self.gate = threading.Event()
        self.arrived = threading.Event()
        super().__init__(self._respond)

    def _respond(self, h):
        self.arrived.set()
        # bounded: a test that forgets to open the gate still ends
        send_file(h, FIXTURES, h.path, lambda: self.gate.wait(60 * TSCALE))


@pytest.fixture
def gated():
    g = GatedServer()
    yield g
    g.gate.set()
    g.close()


def wait_for(cond, what, timeout=30.0):
    deadline = time.monotonic() + timeout * TSCALE
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


# ------------------------------------------- issue 9 item 4: config inherited


def test_version_without_config_inherits_the_default_config(start_server, gated):
    s = start_server("--allow-private-urls", "1")  # the gated file server is on 127.0.0.1
    v1 = created(upload(s, "clf", fields=[("config", json.dumps(LABELED))]))
    assert "config_from" not in v1
    first = predict(s, "clf")
    assert "labels" in first and "scores" in first, first

    # multipart without config
    v2 = created(upload(s, "clf"))
    assert v2["config_from"] == 1 and v2["config"] == LABELED, v2
    # raw bytes without config: inherits from the default, now version 2
    v3 = created(upload_raw(s, "clf"))
    assert v3["config_from"] == 2 and v3["config"] == LABELED, v3
    # registration from a URL without config
    gated.gate.set()
    v4 = created(register(s, {"name": "clf", "source": gated.url("/mlp.pt")}))
    assert v4["config_from"] == 3 and v4["config"] == LABELED, v4
    # what the user sees: the new default still answers with labels and scores
    ans = predict(s, "clf")
    assert ans["version"] == 4
    assert ans == dict(first, version=4), (first, ans)
    # the stored row carries the config too
    got = s.get("/models/clf/versions/4").json()
    assert got["config"] == LABELED


def test_explicit_config_replaces_the_inherited_one(server):
    created(upload(server, "clf", fields=[("config", json.dumps(LABELED))]))
    plain = {"input": {"shape": [4], "dtype": "float32"}, "output": "logits"}
    v2 = created(upload(server, "clf", fields=[("config", json.dumps(plain))]))
    assert "config_from" not in v2 and v2["config"] == plain
    v3 = created(upload_raw(server, "clf", config={}))
    assert "config_from" not in v3 and v3["config"] == {}
    ans = predict(server, "clf")
    assert ans["version"] == 3 and "labels" not in ans


def test_first_version_without_config_has_no_config_from(server):
    v1 = created(upload_raw(server, "fresh"))
    assert "config_from" not in v1 and v1["config"] == {}


# ------------------------------------------------- item 8: repeated fields


@pytest.mark.parametrize("how", ["two_form_fields", "form_and_query"])
def test_repeated_field_refused_and_nothing_leaks(start_server, how):
    s = start_server()
    cfg = json.dumps(LABELED)
    for i in range(3):  # repeated: a leak per request would add up
        if how == "two_form_fields":
            # not adjacent: adjacent parts of one name reach the handler as one value
            r = upload(s, "dup", fields=[("config", cfg), ("metrics", '{"loss": 1}'),
                                         ("config", cfg)])
        else:
            r = upload(s, "dup", fields=[("config", cfg)], params={"config": cfg})
        msg = expect_error(r, 400, "duplicate_field")
        assert "config" in msg and "once" in msg, msg
    assert s.get("/models/dup").status_code == 404, "a refused upload stored a model"
    assert not list((s.store / "blobs").iterdir())
    stop_clean(s)


# -------------------------------- item 7: one download, separate outcomes


@pytest.mark.parametrize("leader", ["wrong_sha256", "bad_config"])
def test_concurrent_registrations_share_only_the_download(start_server, gated, leader):
    s = start_server("--allow-private-urls", "1")  # the gated file server is on 127.0.0.1
    url = gated.url("/mlp.pt")
    bad = {"name": "a", "source": url}
    if leader == "wrong_sha256":
        bad["sha256"] = sha(CNN)
    else:
        bad["config"] = {"input": {"shape": [7], "dtype": "float32"}}  # the MLP takes 4
    good = {"name": "b", "source": url, "sha256": sha(MLP)}
    results = {}

    def go(key, body):
        try:
            results[key] = register(s, body)
        except Exception as e:  # reported below
            results[key] = e

    ta = threading.Thread(target=go, args=("a", bad))
    ta.start()
    assert gated.arrived.wait(30 * TSCALE), "the first registration never started its download"
    tb = threading.Thread(target=go, args=("b", good))
    tb.start()
    # released only once the server says the second request joined the download
    wait_for(lambda: "register b: sharing the download" in s.stderr,
             "the second registration to join the download")
    gated.gate.set()
    ta.join(60 * TSCALE)
    tb.join(60 * TSCALE)
    assert gated.counts.get("/mlp.pt") == 1, gated.counts
    ra, rb = results["a"], results["b"]
    assert isinstance(ra, requests.Response) and isinstance(rb, requests.Response), results
    if leader == "wrong_sha256":
        expect_error(ra, 400, "sha256_mismatch")
    else:
        assert ra.status_code == 422, ra.text
    v = created(rb)
    assert v["model"] == "b" and v["sha256"] == sha(MLP)
    assert s.get("/models/a").status_code == 404
    assert [p.name for p in (s.store / "blobs").iterdir()] == [sha(MLP)]
    wait_for(lambda: not list((s.store / "tmp").iterdir()), "the temp files to go", 5)


# ----------------------------------- item 11: load once, failures remembered


def hold_env(callers, version=None, **extra):
    """MD_TEST_LOAD_HOLD (test-only, handlers/app.c): a load waits until
    `callers` requests asked for it (of `version` only, when given); the hold's
    own bound is scaled, so only the test releases it."""
    env = {"MD_TEST_LOAD_HOLD": str(callers), "MD_TEST_LOAD_HOLD_S": str(int(120 * TSCALE))}
    if version is not None:
        env["MD_TEST_LOAD_HOLD_VERSION"] = str(version)
    env.update(extra)
    return env


def in_background(fn, *args):
    """Run fn(*args) on a thread; returns (thread, result list [value or exception])."""
    out = []

    def run():
        try:
            out.append(fn(*args))
        except Exception as e:  # reported by the caller
            out.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def held(srv, name, version):
    wait_for(lambda: f"model {name} version {version}: load held for the test" in srv.stderr,
             f"the load of {name} version {version} to be held")


def test_concurrent_predicts_load_a_stored_version_once(start_server):
    # the on-demand load waits until 8 requests asked for it, so all 8 are
    # provably concurrent
    s = start_server(env=hold_env(8))
    created(upload(s, "m", fields=[("config", json.dumps(LABELED))]))
    v2 = created(upload(s, "m", fields=[("deploy", "false")]))
    assert v2["version"] == 2 and v2["state"] == "stored"
    results = [None] * 8

    def go(i):
        try:
            results[i] = s.request("POST", "/models/m/versions/2/predict", json=MLP_INPUT[:2],
                                   timeout=60 * TSCALE)
        except Exception as e:  # reported below
            results[i] = e

    threads = [threading.Thread(target=go, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90 * TSCALE)
    for r in results:
        assert isinstance(r, requests.Response) and r.status_code == 200, r
        assert r.json()["version"] == 2 and "labels" in r.json()
    loads = s.stderr.count("model m version 2: loading on demand")
    assert loads == 1, f"8 concurrent predictions loaded version 2 {loads} times"
    loaded = [x for x in s.get("/models/m").json()["loaded"] if x["version"] == 2]
    assert len(loaded) == 1, loaded


def test_failed_version_answers_from_memory(start_server):
    s = start_server()
    created(upload(s, "m", fields=[("config", json.dumps(LABELED))]))
    v2 = created(upload(s, "m", data=CNN, fields=[("deploy", "false"), ("config", "{}")]))
    # the stored bytes go bad on disk (a torn disk, a bad copy)
    blob = s.store / "blobs" / v2["sha256"]
    blob.write_bytes(b"PK\x03\x04" + b"\0" * 200)
    first = s.request("POST", "/models/m/versions/2/predict", json=MLP_INPUT[:2],
                      timeout=30 * TSCALE)
    assert first.status_code == 422, first.text
    assert s.stderr.count("model m version 2: loading on demand") == 1
    second = s.request("POST", "/models/m/versions/2/predict", json=MLP_INPUT[:2],
                       timeout=30 * TSCALE)
    assert second.status_code == 422 and second.json() == first.json(), second.text
    assert s.stderr.count("model m version 2: loading on demand") == 1, \
        "the failed version was loaded again"
    state = s.get("/models/m/versions/2").json()
    assert state["state"] == "failed" and state.get("state_reason"), state
    # the default still serves
    assert predict(s, "m")["version"] == 1


# ------------------- review of the on-demand loads: HTTP threads never load


def v2_body(rows):
    return {"inputs": [{"name": "input0", "shape": [len(rows), len(rows[0])],
                        "datatype": "FP32", "data": rows}]}


@pytest.mark.parametrize("route", ["v2_infer", "predict_default"])
def test_a_held_on_demand_load_leaves_the_only_http_thread_free(start_server, tmp_path, route):
    # a replica with one HTTP thread that has not seen the deploy yet (its
    # store poll is a minute away), so its first request loads on demand
    store = tmp_path / "shared"
    b = start_server("--threads", "1", "--store-poll-ms", "60000", "--default-model", "m",
                     store=store, env=hold_env(2))
    a = start_server(store=store)
    created(upload(a, "m", fields=[("config", json.dumps(LABELED))]))

    def ask():
        if route == "v2_infer":
            return b.request("POST", "/v2/models/m/infer", json=v2_body(MLP_INPUT[:2]),
                             timeout=60 * TSCALE)
        return b.request("POST", "/predict", json=MLP_INPUT[:2], timeout=60 * TSCALE)

    t1, first = in_background(ask)
    held(b, "m", 1)
    # the load is held inside the server: its one HTTP thread must still answer
    assert b.get("/healthz", timeout=5 * TSCALE).status_code == 200
    t2, second = in_background(ask)  # the second caller releases the hold
    t1.join(90 * TSCALE)
    t2.join(90 * TSCALE)
    for r in first + second:
        assert isinstance(r, requests.Response) and r.status_code == 200, r
        body = r.json()
        assert body.get("model_version", body.get("version")) in ("1", 1), body
    assert b.stderr.count("model m version 1: loading on demand") == 1, b.stderr[-3000:]


def test_a_deleted_and_reuploaded_version_loads_again(start_server):
    s = start_server()
    created(upload(s, "m", fields=[("config", json.dumps(LABELED))]))
    v2 = created(upload(s, "m", data=CNN, fields=[("deploy", "false"), ("config", "{}")]))
    (s.store / "blobs" / v2["sha256"]).write_bytes(b"PK\x03\x04" + b"\0" * 200)
    cnn_in = json.loads((FIXTURES / "cnn_input.json").read_text())[:1]
    r = s.request("POST", "/models/m/versions/2/predict", json=cnn_in, timeout=30 * TSCALE)
    assert r.status_code == 422, r.text
    assert s.request("DELETE", "/models/m/versions/2").status_code == 200
    # the same good bytes, as version 2 again
    again = created(upload(s, "m", data=CNN, fields=[("deploy", "false"), ("config", "{}"),
                                                     ("version", "2")]))
    assert again["version"] == 2 and again["sha256"] == v2["sha256"]
    r = s.request("POST", "/models/m/versions/2/predict", json=cnn_in, timeout=30 * TSCALE)
    assert r.status_code == 200, f"the re-uploaded version answered from stale memory: {r.text}"
    assert r.json()["version"] == 2
    assert s.stderr.count("model m version 2: loading on demand") == 2


def test_a_transient_load_failure_is_not_remembered(start_server):
    s = start_server()
    created(upload(s, "m", fields=[("config", json.dumps(LABELED))]))
    v2 = created(upload(s, "m", data=CNN, fields=[("deploy", "false"), ("config", "{}")]))
    blob = s.store / "blobs" / v2["sha256"]
    aside = s.tmp_path / "aside"
    blob.rename(aside)  # a blob missing for a moment: not a bad checkpoint
    cnn_in = json.loads((FIXTURES / "cnn_input.json").read_text())[:1]
    r = s.request("POST", "/models/m/versions/2/predict", json=cnn_in, timeout=30 * TSCALE)
    expect_error(r, 500, "checkpoint_missing")
    aside.rename(blob)
    r = s.request("POST", "/models/m/versions/2/predict", json=cnn_in, timeout=30 * TSCALE)
    assert r.status_code == 200, f"a transient failure was remembered: {r.text}"
    assert s.stderr.count("model m version 2: loading on demand") == 2


def test_waiting_on_a_held_load_gives_up_at_the_versions_timeout(start_server):
    s = start_server(env=hold_env(3, version=2))
    created(upload(s, "m", fields=[("config", json.dumps(LABELED))]))
    ms = int(1000 * TSCALE)
    cfg = dict(LABELED, batching={"timeout_ms": ms})
    created(upload(s, "m", fields=[("deploy", "false"), ("config", json.dumps(cfg))]))

    def ask():
        return s.request("POST", "/models/m/versions/2/predict", json=MLP_INPUT[:2],
                         timeout=60 * TSCALE)

    t1, first = in_background(ask)
    held(s, "m", 2)
    r = ask()  # waits on the held load: gives up at its timeout, not never
    msg = expect_error(r, 504, "model_loading")
    assert "batching.timeout_ms" in msg and str(ms) in msg, msg
    t3, third = in_background(ask)  # the third caller releases the hold
    t1.join(90 * TSCALE)
    t3.join(90 * TSCALE)
    for r in first + third:
        assert isinstance(r, requests.Response) and r.status_code == 200, r
    assert s.stderr.count("model m version 2: loading on demand") == 1


def test_full_deferred_pool_answers_503_and_known_answers_need_no_thread(start_server):
    # one deferred thread (test-only MD_TEST_MAX_DEFERRED), held by a load
    s = start_server(env=hold_env(2, version=2, MD_TEST_MAX_DEFERRED="1"))
    created(upload(s, "m", fields=[("config", json.dumps(LABELED))]))
    created(upload(s, "m", fields=[("deploy", "false")]))
    v3 = created(upload(s, "m", data=CNN, fields=[("deploy", "false"), ("config", "{}")]))
    (s.store / "blobs" / v3["sha256"]).write_bytes(b"PK\x03\x04" + b"\0" * 200)
    created(upload(s, "m", fields=[("deploy", "false")]))  # v4, never loaded
    bad = s.request("POST", "/models/m/versions/3/predict", json=MLP_INPUT[:2],
                    timeout=30 * TSCALE)
    assert bad.status_code == 422, bad.text
    expect_error(s.request("POST", "/models/nope/predict", json=MLP_INPUT[:2]), 404,
                 "model_not_found")
    expect_error(s.request("POST", "/models/m/versions/9/predict", json=MLP_INPUT[:2]), 404,
                 "version_not_found")

    t1, first = in_background(
        lambda: s.request("POST", "/models/m/versions/2/predict", json=MLP_INPUT[:2],
                          timeout=60 * TSCALE))
    held(s, "m", 2)
    # the pool is full: a prediction that needs a deferred thread (a load on
    # demand) is refused at once
    r = s.request("POST", "/models/m/versions/4/predict", json=MLP_INPUT[:2])
    expect_error(r, 503, "too_busy")
    assert r.headers.get("Retry-After"), r.headers
    # what is known in memory is answered without one
    again = s.request("POST", "/models/m/versions/3/predict", json=MLP_INPUT[:2])
    assert again.status_code == 422 and again.json() == bad.json(), again.text
    expect_error(s.request("POST", "/models/nope/predict", json=MLP_INPUT[:2]), 404,
                 "model_not_found")
    r = s.request("POST", "/v2/models/nope/infer", json=v2_body(MLP_INPUT[:2]))
    assert r.status_code == 404, r.text
    expect_error(s.request("POST", "/models/m/versions/9/predict", json=MLP_INPUT[:2]), 404,
                 "version_not_found")
    assert predict(s, "m")["version"] == 1  # a loaded version needs no thread either
    s.kill()  # the held load never ends on its own within the test
    t1.join(30 * TSCALE)


def test_predictions_filling_the_deferred_pool_leave_admin_work_its_own(start_server):
    """Issue 24: 70 image clients took all 64 deferred threads and every
    deploy answered 503. Admin work has its own bound: with the predictions'
    one thread (test-only MD_TEST_MAX_DEFERRED) held by an on-demand load,
    a deploy and a PATCH still run."""
    s = start_server(env=hold_env(2, version=2, MD_TEST_MAX_DEFERRED="1"))
    created(upload(s, "m", fields=[("config", json.dumps(LABELED))]))
    created(upload(s, "m", fields=[("deploy", "false")]))
    created(upload(s, "m", fields=[("deploy", "false")]))
    t1, first = in_background(
        lambda: s.request("POST", "/models/m/versions/2/predict", json=MLP_INPUT[:2],
                          timeout=60 * TSCALE))
    held(s, "m", 2)
    r = s.request("POST", "/models/m/versions/3/predict", json=MLP_INPUT[:2])
    expect_error(r, 503, "too_busy")  # the predictions' bound holds
    v4 = created(upload(s, "m"))       # a deploy gets an admin thread
    assert v4["version"] == 4 and v4["default"] is True, v4
    assert predict(s, "m")["version"] == 4
    # so does a PATCH; its load of version 2 is the held load's second caller
    r = s.request("PATCH", "/models/m", json={"default_version": 2}, timeout=60 * TSCALE)
    assert r.status_code == 200, r.text
    t1.join(60 * TSCALE)
    assert len(first) == 1 and isinstance(first[0], requests.Response), first
    assert first[0].status_code == 200, first[0].text
    assert predict(s, "m")["version"] == 2


def test_admin_work_filling_its_slots_leaves_predictions_theirs(start_server):
    """The other way round: admin work (test-only MD_TEST_MAX_ADMIN_DEFERRED=1)
    has one thread, held by a PATCH's load; another deploy is refused with 503,
    and a prediction that needs a deferred thread still gets one."""
    s = start_server(env=hold_env(2, version=2, MD_TEST_MAX_ADMIN_DEFERRED="1"))
    created(upload(s, "m", fields=[("config", json.dumps(LABELED))]))
    created(upload(s, "m", fields=[("deploy", "false")]))
    t1, first = in_background(
        lambda: s.request("PATCH", "/models/m", json={"default_version": 2},
                          timeout=60 * TSCALE))
    held(s, "m", 2)
    r = upload(s, "m")
    expect_error(r, 503, "too_busy")
    assert r.headers.get("Retry-After"), r.headers
    # the prediction's load is the held load's second caller: both finish
    assert predict(s, "m", version=2)["version"] == 2
    t1.join(60 * TSCALE)
    assert len(first) == 1 and isinstance(first[0], requests.Response), first
    assert first[0].status_code == 200, first[0].text
    assert predict(s, "m")["version"] == 2


def test_store_sync_joins_a_load_in_progress_instead_of_loading_again(start_server, tmp_path):
    store = tmp_path / "shared"
    b = start_server("--store-poll-ms", "100", store=store, env=hold_env(2, version=2))
    a = start_server(store=store)
    created(upload(a, "m", fields=[("config", json.dumps(LABELED))]))
    wait_for(lambda: b.request("POST", "/models/m/predict", json=MLP_INPUT[:2]).status_code
             == 200, "b to serve version 1")
    v2 = created(upload(a, "m", fields=[("deploy", "false")]))
    assert v2["version"] == 2 and v2["default"] is False, v2
    # b loads version 2 on demand; the load is held until a second caller asks
    t1, first = in_background(
        lambda: b.request("POST", "/models/m/versions/2/predict", json=MLP_INPUT[:2],
                          timeout=30 * TSCALE))
    held(b, "m", 2)
    # a replica makes it the default: b's store sync must join that load (the
    # second caller, which releases the hold), not start a load of its own
    r = a.request("PATCH", "/models/m", json={"default_version": 2}, timeout=30 * TSCALE)
    assert r.status_code == 200, r.text
    t1.join(60 * TSCALE)
    assert first and isinstance(first[0], requests.Response), first
    assert first[0].status_code == 200, first[0].text
    wait_for(lambda: predict(b, "m")["version"] == 2, "b to serve version 2 as the default")
    assert b.stderr.count("model m version 2: loading") == 1, b.stderr[-3000:]


def test_a_version_deleted_while_it_loads_is_not_kept(start_server):
    """Review: an on-demand load that finished after DELETE of its version put
    the deleted model back in memory, served until a restart. The load is held
    by the test hook while the version is deleted; once it ends, the version
    is not loaded and answers 404."""
    s = start_server(env={"MD_TEST_LOAD_HOLD": "2", "MD_TEST_LOAD_HOLD_VERSION": "2",
                          "MD_TEST_LOAD_HOLD_S": str(int(5 * TSCALE))})
    created(upload(s, "m", fields=[("config", json.dumps(LABELED))]))
    assert created(upload(s, "m", fields=[("deploy", "false")]))["version"] == 2
    first = []
    t = threading.Thread(target=lambda: first.append(
        s.request("POST", "/models/m/versions/2/predict", json=MLP_INPUT[:2],
                  timeout=60 * TSCALE)))
    t.start()
    deadline = time.monotonic() + 30 * TSCALE
    while "model m version 2: load held for the test" not in s.stderr:
        assert time.monotonic() < deadline, s.stderr
        time.sleep(0.02)
    r = s.request("DELETE", "/models/m/versions/2", timeout=30 * TSCALE)
    assert r.status_code == 200, r.text
    t.join(60 * TSCALE)
    assert first and first[0].status_code in (200, 404), first  # asked before the delete
    loaded = [x for x in s.get("/models/m").json()["loaded"] if x["version"] == 2]
    assert loaded == [], loaded
    r = s.request("POST", "/models/m/versions/2/predict", json=MLP_INPUT[:2], timeout=30 * TSCALE)
    assert r.status_code == 404, r.text
    assert "model m version 2 changed while it loaded; not kept" in s.stderr, s.stderr[-2000:]
