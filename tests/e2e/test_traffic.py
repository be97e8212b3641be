"""
test_traffic.py - weighted traffic splits of unversioned predictions (issue
28), against the real binary: PATCH /models/NAME {"traffic": {...}} sends
each version its share of /predict, /models/NAME/predict, /predictions/NAME,
V2 and KServe V1 requests that name no version; a request naming a version
is never rerouted; a sticky header keeps a client on one version on every
replica; bad splits are refused with nothing changed; a version with a share
cannot be deleted nor collected by retention; the split survives a restart
and a second replica on the same store follows it.

Routing is deterministic (handlers/traffic.c: 100 consecutive requests
cover the 100 slots once; a sticky value hashes to a slot), so the bounds
below are binomial bounds the implementation meets exactly or far inside:
they cannot flake.
"""
import json
import threading
import time
from collections import Counter

import pytest
import requests

from conftest import REPO, TSCALE

FIXTURES = REPO / "tests" / "fixtures"
MLP = (FIXTURES / "mlp.pt").read_bytes()
CONFIG = {"input": {"shape": [4], "dtype": "float32"}}
ROW = [[0.5, -1.0, 2.0, 0.25]]


def deploy(srv, name="m", make_default="true"):
    r = srv.request("POST", f"/models/{name}/versions",
                    data={"config": json.dumps(CONFIG), "make_default": make_default},
                    files={"checkpoint": ("model.pt", MLP, "application/octet-stream")},
                    timeout=30 * TSCALE)
    assert r.status_code == 201, r.text
    return r.json()["version"]


def deploy_throws(srv):
    """A version of x * 2 that raises for a row whose first value is < 0."""
    throws = (FIXTURES / "throws.pt").read_bytes()
    r = srv.request("POST", "/models/m/versions",
                    data={"config": json.dumps(CONFIG), "make_default": "false"},
                    files={"checkpoint": ("t.pt", throws, "application/octet-stream")},
                    timeout=30 * TSCALE)
    assert r.status_code == 201, r.text
    return r.json()["version"]


def patch(srv, body, name="m"):
    return srv.request("PATCH", f"/models/{name}", json=body, timeout=30 * TSCALE)


def answered_by(resp):
    assert resp.status_code == 200, resp.text
    return int(resp.headers["X-Model-Version"])


def predict(srv, name="m", session=None, headers=None):
    return answered_by((session or requests).post(f"{srv.url}/models/{name}/predict", json=ROW,
                                                  headers=headers or {}, timeout=30 * TSCALE))


def three_versions(srv):
    for _ in range(3):
        deploy(srv)
    return srv


def poll(fn, what, timeout=30.0):
    deadline = time.monotonic() + timeout * TSCALE
    while time.monotonic() < deadline:
        got = fn()
        if got:
            return got
        time.sleep(0.05)
    pytest.fail(f"timed out waiting for {what}")


def binomial_ok(k, n, p, sigmas=5.0):
    mean = n * p
    sd = (n * p * (1 - p)) ** 0.5
    return abs(k - mean) <= sigmas * sd


def routed(srv, name="m"):
    out = {}
    for line in srv.get("/metrics").text.splitlines():
        if line.startswith("modeld_traffic_routed_total{") and f'model="{name}"' in line:
            v = int(line.split('version="')[1].split('"')[0])
            out[v] = int(float(line.rsplit(" ", 1)[1]))
    return out


def test_a_90_10_split_sends_each_version_its_share(start_server):
    srv = three_versions(start_server())
    r = patch(srv, {"traffic": {"1": 90, "2": 10}})
    assert r.status_code == 200, r.text
    assert r.json()["traffic"] == {"1": 90, "2": 10} and r.json()["default_version"] == 3
    counts = Counter()
    lock = threading.Lock()

    def client():
        s = requests.Session()
        for _ in range(500):
            v = predict(srv, session=s)
            with lock:
                counts[v] += 1

    ts = [threading.Thread(target=client) for _ in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(300)
    assert sum(counts.values()) == 2000, counts
    assert set(counts) == {1, 2}, counts  # never the default (3) while a split stands
    assert binomial_ok(counts[2], 2000, 0.10), counts
    assert routed(srv) == {1: counts[1], 2: counts[2]}
    # the answers themselves are the model's (both versions hold the same bytes)
    body = requests.post(f"{srv.url}/models/m/predict", json=ROW, timeout=30).json()
    assert len(body["predictions"]) == 1


def test_every_unversioned_dialect_follows_the_split(start_server):
    srv = three_versions(start_server())
    assert patch(srv, {"traffic": {"2": 100}}).status_code == 200
    s = requests.Session()
    assert predict(srv, session=s) == 2
    assert answered_by(s.post(f"{srv.url}/predict", json=ROW, timeout=30)) == 2
    assert answered_by(s.post(f"{srv.url}/predictions/m", json=ROW, timeout=30)) == 2
    v1 = s.post(f"{srv.url}/v1/models/m:predict", json={"instances": ROW}, timeout=30)
    assert answered_by(v1) == 2
    v2 = s.post(f"{srv.url}/v2/models/m/infer", json={"inputs": [
        {"name": "input", "shape": [1, 4], "datatype": "FP32", "data": ROW}]}, timeout=30)
    assert answered_by(v2) == 2 and v2.json()["model_version"] == "2"


def test_a_request_naming_a_version_is_never_rerouted(start_server):
    srv = three_versions(start_server())
    assert patch(srv, {"traffic": {"2": 100}}).status_code == 200
    s = requests.Session()
    for v in (1, 3):
        for _ in range(20):
            r = s.post(f"{srv.url}/models/m/versions/{v}/predict", json=ROW, timeout=30)
            assert answered_by(r) == v
        r = s.post(f"{srv.url}/v2/models/m/versions/{v}/infer", json={"inputs": [
            {"name": "input", "shape": [1, 4], "datatype": "FP32", "data": ROW}]}, timeout=30)
        assert answered_by(r) == v
    assert routed(srv) == {2: 0}


def test_a_sticky_header_keeps_each_user_on_one_version(start_server, tmp_path):
    store = tmp_path / "shared"
    a = start_server(store=store)
    three_versions(a)
    b = start_server(store=store)
    r = patch(a, {"traffic": {"1": 90, "3": 10}, "sticky_header": "X-User-Id"})
    assert r.status_code == 200, r.text
    assert r.json()["sticky_header"] == "X-User-Id"
    poll(lambda: predict(b) in (1, 3) and b.get("/models/m").json()["traffic"],
         "replica b follows the split")
    sa, sb = requests.Session(), requests.Session()
    users = {}
    for i in range(300):
        uid = f"user-{i}"
        seen = {predict(a, session=sa, headers={"X-User-Id": uid}) for _ in range(3)}
        assert len(seen) == 1, (uid, seen)
        users[uid] = seen.pop()
    on_3 = sum(1 for v in users.values() if v == 3)
    assert binomial_ok(on_3, 300, 0.10), on_3
    # the same value lands on the same version on the other replica
    poll(lambda: all(predict(b, session=sb, headers={"X-User-Id": u}) == v
                     for u, v in list(users.items())[:50]), "replica b routes users alike")
    # without the header, the split applies as to anyone
    assert {predict(a, session=sa) for _ in range(100)} == {1, 3}


def test_traffic_null_returns_to_the_default(start_server):
    srv = three_versions(start_server())
    assert patch(srv, {"traffic": {"1": 50, "2": 50}, "sticky_header": "X-User"}).status_code \
        == 200
    assert {predict(srv) for _ in range(10)} == {1, 2}
    r = patch(srv, {"traffic": None})
    assert r.status_code == 200, r.text
    assert r.json()["traffic"] is None and r.json()["sticky_header"] is None
    assert {predict(srv) for _ in range(10)} == {3}
    assert srv.get("/models/m").json()["traffic"] is None


@pytest.mark.parametrize("body, status, code", [
    ({"traffic": {"1": 50, "2": 40}}, 400, "invalid_traffic"),
    ({"traffic": {"1": 90, "2": 20}}, 400, "invalid_traffic"),
    ({"traffic": {"one": 100}}, 400, "invalid_traffic"),
    ({"traffic": {"01": 100}}, 400, "invalid_traffic"),
    ({"traffic": {"1": -10, "2": 110}}, 400, "invalid_traffic"),
    ({"traffic": {"1": 50.5, "2": 49.5}}, 400, "invalid_traffic"),
    ({"traffic": {}}, 400, "invalid_traffic"),
    ({"traffic": [1, 2]}, 400, "invalid_traffic"),
    ({"traffic": {str(v): (100 if v == 1 else 0) for v in range(1, 18)}}, 400, "invalid_traffic"),
    ({"traffic": {"1": 50, "9": 50}}, 404, "version_not_found"),
    ({"traffic": {"1": 100}, "sticky_header": "X User"}, 400, "invalid_traffic"),
    ({"traffic": {"1": 100}, "sticky_header": 7}, 400, "invalid_traffic"),
    ({"traffic": {"1": 100}, "weights": 7}, 400, "unknown_field"),
])
def test_a_bad_split_is_refused_and_changes_nothing(start_server, body, status, code):
    srv = three_versions(start_server())
    assert patch(srv, {"traffic": {"2": 100}}).status_code == 200
    before = srv.get("/models/m").json()
    r = patch(srv, body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == code, r.text
    assert r.json()["error"]["message"]
    after = srv.get("/models/m").json()
    assert after["traffic"] == before["traffic"] == {"2": 100}
    assert after["sticky_header"] is None
    assert {predict(srv) for _ in range(5)} == {2}
    assert patch(srv, {"traffic": {"1": 100}}, name="nope").status_code == 404


def test_a_version_with_a_share_is_kept(start_server):
    srv = three_versions(start_server())
    assert patch(srv, {"traffic": {"1": 10, "3": 90}}).status_code == 200
    r = srv.request("DELETE", "/models/m/versions/1")
    assert r.status_code == 409 and r.json()["error"]["code"] == "version_in_traffic", r.text
    # retention keeps it too, while removing what has no share
    r = patch(srv, {"retention": {"keep_last": 1}})
    assert r.status_code == 200, r.text
    assert [v["version"] for v in r.json()["versions"]] == [1, 3]
    assert {predict(srv) for _ in range(20)} == {1, 3}
    # a share of 0 is no share
    assert patch(srv, {"traffic": {"1": 0, "3": 100}}).status_code == 200
    assert srv.request("DELETE", "/models/m/versions/1").status_code == 200


def test_the_split_survives_a_restart(start_server, tmp_path):
    store = tmp_path / "store"
    a = start_server(store=store)
    three_versions(a)
    assert patch(a, {"traffic": {"1": 20, "2": 80}}).status_code == 200
    a.stop()
    b = start_server(store=store)
    counts = Counter(predict(b) for _ in range(100))
    assert counts == {1: 20, 2: 80}, counts  # 100 in a row cover the 100 slots once
    assert b.get("/models/m").json()["traffic"] == {"1": 20, "2": 80}


def test_a_second_replica_follows_a_change(start_server, tmp_path):
    store = tmp_path / "shared"
    a = start_server(store=store)
    three_versions(a)
    b = start_server(store=store)
    assert predict(b) == 3
    assert patch(a, {"traffic": {"1": 100}}).status_code == 200
    poll(lambda: predict(b) == 1, "replica b sends its unversioned requests to version 1")
    assert patch(a, {"traffic": None}).status_code == 200
    poll(lambda: predict(b) == 3, "replica b returns to the default")
    # deleting the model drops its split on both
    assert a.request("DELETE", "/models/m").status_code == 200
    poll(lambda: requests.post(f"{b.url}/models/m/predict", json=ROW, timeout=30).status_code
         == 404, "replica b forgets the model")


def test_a_version_shows_its_live_numbers(start_server):
    """GET /models/NAME/versions/V: requests, errors (model errors, not a
    client's bad request), error rate and latency percentiles since the
    version was loaded here: what a canary is judged by."""
    srv = start_server()
    throws = (FIXTURES / "throws.pt").read_bytes()
    r = srv.request("POST", "/models/t/versions",
                    data={"config": json.dumps({"input": {"shape": [2]}})},
                    files={"checkpoint": ("t.pt", throws, "application/octet-stream")},
                    timeout=30 * TSCALE)
    assert r.status_code == 201, r.text
    live = srv.get("/models/t/versions/1").json()["live"]
    assert live == {"requests": 0, "errors": 0, "error_rate": 0.0, "p50_ms": None,
                    "p99_ms": None}, live
    s = requests.Session()
    for i in range(40):
        row = [[-1.0, 2.0]] if i % 10 == 0 else [[1.0, 2.0]]  # every tenth one fails
        r = s.post(f"{srv.url}/models/t/predict", json=row, timeout=30)
        assert r.status_code == (200 if i % 10 else 422), r.text
    # a client's mistakes are not the version's
    assert s.post(f"{srv.url}/models/t/predict", json=[[1.0, 2.0, 3.0]],
                  timeout=30).status_code == 400
    assert s.post(f"{srv.url}/models/t/predict", data="[[1,", timeout=30).status_code == 400
    live = srv.get("/models/t/versions/1").json()["live"]
    assert live["requests"] == 40 and live["errors"] == 4, live
    assert live["error_rate"] == pytest.approx(0.1)
    assert 0 < live["p50_ms"] <= live["p99_ms"], live
    listed = srv.get("/models/t/versions").json()["versions"][0]
    assert listed["live"]["requests"] == 40


def history(srv, name="m"):
    r = srv.get(f"/models/{name}/history")
    assert r.status_code == 200, r.text
    return r.json()["history"]


def test_promote_when_promotes_a_healthy_canary(start_server):
    srv = start_server()
    deploy(srv)
    deploy(srv, make_default="false")
    r = patch(srv, {"traffic": {"1": 50, "2": 50}, "reason": "canary of v2",
                    "promote_when": {"min_requests": 20, "max_error_rate": 0.1}})
    assert r.status_code == 200, r.text
    assert r.json()["promote_when"] == {"min_requests": 20, "max_error_rate": 0.1}
    s = requests.Session()
    for _ in range(100):  # 50 of them to version 2 (100 in a row hold the shares exactly)
        predict(srv, session=s)
    m = poll(lambda: (lambda m: m if m["default_version"] == 2 else None)(
        srv.get("/models/m").json()), "promote_when makes version 2 the default")
    assert m["traffic"] is None and m["promote_when"] is None
    assert {predict(srv, session=s) for _ in range(10)} == {2}
    h = [e for e in history(srv) if e["by"] != "deploy"]
    assert h[0]["by"] == "api" and h[0]["reason"] == "canary of v2"
    assert h[0]["change"]["traffic"] == {"1": 50, "2": 50} and h[0]["request_id"]
    assert h[-1]["by"] == "promote_when", h
    assert h[-1]["change"] == {"default_version": 2, "traffic": None}
    assert "version 2 answered" in h[-1]["reason"] and h[-1]["at"].endswith("Z")


def test_promote_when_rolls_back_a_canary_that_fails_5_percent(start_server):
    srv = start_server()
    deploy(srv)  # version 1: the MLP, answers every row
    deploy_throws(srv)  # version 2 fails a row whose first value is < 0
    r = patch(srv, {"traffic": {"1": 50, "2": 50},
                    "promote_when": {"min_requests": 100, "max_error_rate": 0.01}})
    assert r.status_code == 200, r.text
    s = requests.Session()
    codes = Counter()
    for i in range(400):
        row = [[-1.0, 2.0, 3.0, 4.0]] if i % 20 == 0 else ROW  # 5 % of the rows
        codes[s.post(f"{srv.url}/models/m/predict", json=row, timeout=30).status_code] += 1
        if srv.get("/models/m").json()["traffic"] is None:
            break
    m = poll(lambda: (lambda m: m if m["traffic"] is None else None)(
        srv.get("/models/m").json()), "promote_when takes version 2's share back")
    assert m["default_version"] == 1 and m["promote_when"] is None
    assert codes[422] >= 2, codes  # the canary's failures reached clients until then
    # now every request goes to version 1, which answers them all
    r = s.post(f"{srv.url}/models/m/predict", json=[[-1.0, 2.0, 3.0, 4.0]], timeout=30)
    assert answered_by(r) == 1
    h = history(srv)[-1]
    assert h["by"] == "promote_when" and h["change"] == {"traffic": None}, h
    assert "version 2 failed" in h["reason"], h


def test_history_records_who_changed_the_default_and_why(start_server):
    srv = three_versions(start_server())
    # each deploy made its version the default: recorded too
    assert [(e["by"], e["change"]) for e in history(srv)] == [
        ("deploy", {"default_version": v}) for v in (1, 2, 3)]
    assert history(srv)[0]["reason"] == "deployed as the default"
    assert history(srv)[1]["reason"] == "deployed as the default"
    r = patch(srv, {"default_version": 1, "reason": "v3 regressed on night traffic"})
    assert r.status_code == 200, r.text
    assert patch(srv, {"traffic": {"1": 90, "2": 10}}).status_code == 200
    assert patch(srv, {"traffic": None}).status_code == 200
    h = [e for e in history(srv) if e["by"] == "api"]
    assert [e["change"] for e in h] == [{"default_version": 1}, {"traffic": {"1": 90, "2": 10}},
                                        {"traffic": None}]
    assert h[0]["reason"] == "v3 regressed on night traffic" and "reason" not in h[1]
    assert all(e["by"] == "api" and e["at"] for e in h)
    # a refused change leaves no trace
    assert patch(srv, {"traffic": {"1": 50}}).status_code == 400
    assert patch(srv, {"reason": 7, "default_version": 2}).status_code == 400
    assert len(history(srv)) == 6
    assert srv.get("/models/nope/history").status_code == 404


@pytest.mark.parametrize("when", [
    {"min_requests": 0, "max_error_rate": 0.1},
    {"min_requests": 10},
    {"max_error_rate": 0.1},
    {"min_requests": 10, "max_error_rate": 1.5},
    {"min_requests": 10, "max_error_rate": 0.1, "min_agreement": 2},
    {"min_requests": 10, "max_error_rate": 0.1, "max_latency": 2},
    [10, 0.1],
])
def test_a_bad_promote_when_is_refused(start_server, when):
    srv = three_versions(start_server())
    r = patch(srv, {"traffic": {"1": 50, "3": 50}, "promote_when": when})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_promote_when", r.text
    assert srv.get("/models/m").json()["traffic"] is None


def test_a_patch_of_several_things_checks_the_split_before_changing_any(start_server):
    srv = three_versions(start_server())
    # the new split's versions are kept by the retention of the same PATCH
    r = patch(srv, {"retention": {"keep_last": 1}, "traffic": {"1": 50, "3": 50}})
    assert r.status_code == 200, r.text
    assert [v["version"] for v in r.json()["versions"]] == [1, 3]
    assert r.json()["traffic"] == {"1": 50, "3": 50}
    # a split naming a missing version changes nothing else of the PATCH
    r = patch(srv, {"default_version": 1, "traffic": {"3": 50, "99": 50}})
    assert r.status_code == 404 and r.json()["error"]["code"] == "version_not_found", r.text
    m = srv.get("/models/m").json()
    assert m["default_version"] == 3 and m["traffic"] == {"1": 50, "3": 50}
    # clearing the split clears its sticky header, even when one is given
    r = patch(srv, {"traffic": None, "sticky_header": "X-User"})
    assert r.status_code == 200 and r.json()["sticky_header"] is None, r.text
    # 0 shares are not kept: such a version is no part of the split
    r = patch(srv, {"traffic": {"1": 0, "3": 100}})
    assert r.status_code == 200 and r.json()["traffic"] == {"3": 100}, r.text


def test_an_error_answer_names_its_version_too(start_server):
    srv = start_server()
    deploy(srv)
    deploy_throws(srv)
    assert patch(srv, {"traffic": {"2": 100}}).status_code == 200
    r = requests.post(f"{srv.url}/models/m/predict", json=[[-1.0, 2.0, 3.0, 4.0]], timeout=30)
    assert r.status_code == 422 and r.headers["X-Model-Version"] == "2", (r.status_code, r.text)


# ---------------------------------------------------------------- shadow


def shadow_pair(srv, name="m"):
    r = srv.get(f"/models/{name}/shadow")
    assert r.status_code == 200, r.text
    pairs = r.json()["pairs"]
    return pairs[0] if pairs else None


def settled(srv, n, name="m"):
    """The shadow pair once n requests were compared, failed or dropped."""
    def done():
        p = shadow_pair(srv, name)
        return p if p and p["compared"] + p["errors"] + p["dropped"] + \
            p["shape_mismatches"] >= n else None
    return poll(done, f"{n} shadow requests settled")


def rows(seed, n=3):
    import random
    rnd = random.Random(seed)
    return [[rnd.uniform(-2, 2) for _ in range(4)] for _ in range(n)]


def test_a_shadow_copy_of_the_same_model_agrees_fully(start_server):
    srv = start_server()
    deploy(srv)
    deploy(srv, make_default="false")
    r = patch(srv, {"shadow": {"version": 2}})
    assert r.status_code == 200, r.text
    assert r.json()["shadow"] == {"version": 2, "percent": 100}
    s = requests.Session()
    for i in range(50):
        r = s.post(f"{srv.url}/models/m/predict", json=rows(i), timeout=30)
        assert answered_by(r) == 1  # the client only ever sees the primary
    p = settled(srv, 50)
    assert p["primary"] == 1 and p["shadow"] == 2, p
    assert p["compared"] == 50 and p["rows"] == 150 and p["errors"] == 0, p
    assert p["agreement"] == 1.0 and p["max_abs_diff"] <= 1e-5, p
    assert p["primary_p50_ms"] > 0 and p["shadow_p50_ms"] > 0, p
    # a request naming a version is not shadowed
    for i in range(5):
        assert answered_by(s.post(f"{srv.url}/models/m/versions/1/predict", json=rows(i),
                                  timeout=30)) == 1
    assert shadow_pair(srv)["compared"] == 50
    text = srv.get("/metrics").text
    assert 'modeld_shadow_compared_total{model="m",primary="1",shadow="2"} 50' in text


def test_a_shadow_agrees_with_the_primary_as_pytorch_says(start_server, tmp_path):
    torch = pytest.importorskip("torch")
    paths = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        net = torch.nn.Sequential(torch.nn.Linear(4, 3)).eval()
        path = tmp_path / f"lin{seed}.pt"
        torch.jit.script(net).save(str(path))
        paths.append((path, net))
    srv = start_server()
    for (path, _), default in zip(paths, ("true", "false")):
        r = srv.request("POST", "/models/m/versions",
                        data={"config": json.dumps(CONFIG), "make_default": default},
                        files={"checkpoint": ("m.pt", path.read_bytes(),
                                              "application/octet-stream")},
                        timeout=30 * TSCALE)
        assert r.status_code == 201, r.text
    assert patch(srv, {"shadow": {"version": 2, "percent": 100}}).status_code == 200
    s = requests.Session()
    sent = []
    for i in range(40):
        x = rows(100 + i, 4)
        sent.extend(x)
        assert answered_by(s.post(f"{srv.url}/models/m/predict", json=x, timeout=30)) == 1
    p = settled(srv, 40)
    with torch.no_grad():
        x = torch.tensor(sent, dtype=torch.float32)
        a, b = paths[0][1](x), paths[1][1](x)
    agree = int((a.argmax(1) == b.argmax(1)).sum())
    assert p["rows"] == 160 and p["compared"] == 40, p
    assert 0 < agree < 160  # two different models: some rows disagree
    assert p["agreement"] == pytest.approx(agree / 160, abs=1e-12), (p, agree)
    assert p["max_abs_diff"] == pytest.approx(float((a - b).abs().max()), abs=1e-5), p


def test_a_shadow_that_throws_never_affects_the_primary(start_server):
    srv = start_server()
    deploy(srv)
    deploy_throws(srv)
    s = requests.Session()
    want = {}
    for i in range(100):
        row = [[-1.0, 2.0, 3.0, 4.0]] if i % 10 == 0 else [[abs(v) for v in rows(i, 1)[0]]]
        want[i] = s.post(f"{srv.url}/models/m/versions/1/predict", json=row,
                         timeout=30).json()["predictions"]
    assert patch(srv, {"shadow": {"version": 2}}).status_code == 200
    for i in range(100):
        row = [[-1.0, 2.0, 3.0, 4.0]] if i % 10 == 0 else [[abs(v) for v in rows(i, 1)[0]]]
        r = s.post(f"{srv.url}/models/m/predict", json=row, timeout=30)
        assert answered_by(r) == 1
        assert r.json()["predictions"] == want[i]
    p = settled(srv, 100)
    # the MLP answers 3 classes where x * 2 answers 4 values: no rows to compare
    assert p["errors"] == 10 and p["shape_mismatches"] == 90 and p["dropped"] == 0, p
    live = srv.get("/models/m/versions/1").json()["live"]
    assert live["errors"] == 0 and live["requests"] == 200, live  # both rounds, no error


def test_a_shadow_share_and_its_rules(start_server):
    srv = three_versions(start_server())
    assert patch(srv, {"shadow": {"version": 1, "percent": 30}}).status_code == 200
    s = requests.Session()
    for i in range(100):
        assert predict(srv, session=s) == 3
    p = settled(srv, 30)
    assert p["compared"] + p["dropped"] + p["errors"] + p["shape_mismatches"] == 30, p
    r = srv.request("DELETE", "/models/m/versions/1")
    assert r.status_code == 409 and r.json()["error"]["code"] == "version_in_traffic", r.text
    for bad in ({"version": 0}, {"version": 1, "percent": 0}, {"version": 1, "percent": 101},
                {"percent": 50}, {"version": "1"}, {"version": 1, "extra": 1}, 7):
        r = patch(srv, {"shadow": bad})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_shadow", r.text
    r = patch(srv, {"shadow": {"version": 9}})
    assert r.status_code == 404, r.text
    assert srv.get("/models/m").json()["shadow"] == {"version": 1, "percent": 30}
    r = patch(srv, {"shadow": None, "reason": "enough"})
    assert r.status_code == 200 and r.json()["shadow"] is None, r.text
    assert srv.request("DELETE", "/models/m/versions/1").status_code == 200
    assert history(srv)[-1]["change"] == {"shadow": None}


def test_promote_when_promotes_a_shadow_that_agrees(start_server):
    srv = start_server()
    deploy(srv)
    deploy(srv, make_default="false")
    r = patch(srv, {"shadow": {"version": 2}, "promote_when": {
        "min_requests": 30, "max_error_rate": 0.0, "min_agreement": 0.99}})
    assert r.status_code == 200, r.text
    s = requests.Session()
    for i in range(30):
        assert answered_by(s.post(f"{srv.url}/models/m/predict", json=rows(i),
                                  timeout=30)) == 1
    m = poll(lambda: (lambda m: m if m["default_version"] == 2 else None)(
        srv.get("/models/m").json()), "promote_when makes the shadow the default")
    assert m["shadow"] is None and m["promote_when"] is None
    h = history(srv)[-1]
    assert h["by"] == "promote_when" and h["change"] == {"shadow": None, "default_version": 2}
    assert "agreement of 1.000000" in h["reason"], h


def test_promote_when_ends_a_shadow_that_fails(start_server):
    srv = start_server()
    deploy(srv)
    deploy_throws(srv)
    r = patch(srv, {"shadow": {"version": 2}, "promote_when": {
        "min_requests": 50, "max_error_rate": 0.02}})
    assert r.status_code == 200, r.text
    s = requests.Session()
    for i in range(100):
        row = [[-1.0, 2.0, 3.0, 4.0]] if i % 10 == 0 else [[abs(v) for v in rows(i, 1)[0]]]
        assert answered_by(s.post(f"{srv.url}/models/m/predict", json=row, timeout=30)) == 1
        if srv.get("/models/m").json()["shadow"] is None:
            break
    m = poll(lambda: (lambda m: m if m["shadow"] is None else None)(
        srv.get("/models/m").json()), "promote_when ends the failing shadow")
    assert m["default_version"] == 1
    h = history(srv)[-1]
    assert h["by"] == "promote_when" and h["change"] == {"shadow": None}, h
    assert "shadow version 2 failed" in h["reason"], h
