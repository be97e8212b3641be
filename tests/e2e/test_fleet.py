"""
test_fleet.py - two and three replicas behind a real nginx (docker/nginx.conf,
as test_nginx.py runs it) on one throwaway PostgreSQL 15 (index_url, pg.py)
behave as one server to a client (issue 25):

- a deploy through nginx is served by every replica, each asked directly,
  within a bound: its unversioned predictions name the new version and give
  the fixture's answer;
- a default change, a version's delete and a model's delete through nginx
  are seen by every replica;
- concurrent deploys through nginx get exactly 1..N, one default, and every
  replica ends up serving the default the index names;
- PostgreSQL stopped (fast and immediate): predictions through nginx keep
  answering, a deploy answers 503 index_unavailable with Retry-After, every
  replica stays ready; started again, deploys work and reach every replica.

Blobs: in S3 (s3rver behind the SigV4-checking proxy), each replica with a
cache directory of its own (the `blobs` fixture), so the replicas share
nothing on disk, as on several hosts.

Every wait polls with a deadline; nothing sleeps to reach the middle of
something, and the bounds are generous (they say "converges", not "fast":
bench/cluster.py measures how fast).
"""
import json
import threading
import time

import numpy as np
import pytest
import requests

from conftest import REPO, TSCALE, Server
from test_nginx import Nginx

FIXTURES = REPO / "tests" / "fixtures"
MLP = (FIXTURES / "mlp.pt").read_bytes()
MLP_CONFIG = {"input": {"shape": [4]}}
MLP_IN = json.loads((FIXTURES / "mlp_input.json").read_text())
MLP_OUT = np.array(json.loads((FIXTURES / "mlp_expected.json").read_text()), dtype=np.float64)
CONVERGE_S = 20.0   # a generous bound: NOTIFY brings a change in milliseconds, the poll in 1 s


@pytest.fixture
def blobs(tmp_path, s3):
    """blobs(i) -> (store directory, extra args, extra env) for replica i:
    a cache directory of its own, ["--blob-url", "s3://BUCKET/PREFIX"] and
    the AWS_* environment of the `s3` fixture (s3rver behind the
    SigV4-checking proxy), so replicas share nothing on disk."""
    return lambda i: (tmp_path / f"cache-{i + 1}", ["--blob-url", f"s3://{s3.bucket}/fleet"],
                      s3.env())


class Fleet:
    def __init__(self, replicas, nginx):
        self.replicas = replicas
        self.nginx = nginx
        self.url = nginx.url

    def deploy(self, name="m", timeout=60, **fields):
        form = {"config": json.dumps(MLP_CONFIG)}
        form.update(fields)
        return requests.post(self.url + f"/models/{name}/versions", data=form,
                             files={"checkpoint": ("model.pt", MLP, "application/octet-stream")},
                             timeout=timeout * TSCALE)

    def each(self, what, cond, timeout=CONVERGE_S):
        """Poll until cond(replica) holds on every replica; fail naming the laggards."""
        deadline = time.monotonic() + timeout * TSCALE
        pending = list(self.replicas)
        last = {}
        while pending:
            for s in list(pending):
                try:
                    ok, last[s.port] = cond(s)
                except requests.RequestException as e:
                    ok, last[s.port] = False, repr(e)
                if ok:
                    pending.remove(s)
            if not pending:
                return
            if time.monotonic() > deadline:
                pytest.fail(f"{what}: replicas {[s.port for s in pending]} not within "
                            f"{timeout * TSCALE:.0f} s; last answers: "
                            f"{ {s.port: last.get(s.port) for s in pending} }")
            time.sleep(0.02)


@pytest.fixture
def fleet(tmp_path, pg_url, blobs):
    """fleet(n) -> a Fleet of n replicas on one PostgreSQL database, nginx in front."""
    started = []
    proxies = []

    def make(n):
        replicas = []
        for i in range(n):
            store, args, env = blobs(i)
            s = Server(tmp_path, args=["--index-url", pg_url, *args], env=env, store=store,
                       access_log=tmp_path / f"access-{i + 1}.log")
            started.append(s)
            replicas.append(s.start(timeout=30))
        nginx = Nginx(tmp_path, *[s.port for s in replicas])
        proxies.append(nginx)
        nginx.start()
        return Fleet(replicas, nginx)

    try:
        yield make
    finally:
        for p in proxies:
            p.stop()
        for s in started:
            s.finish()


def created(r):
    assert r.status_code == 201, f"expected 201, got {r.status_code}: {r.text!r}"
    return r.json()


def serves(version, path="/models/m/predict"):
    """cond(replica): its prediction at `path` answers `version` with the fixture's values."""

    def cond(s):
        r = s.request("POST", path, json=MLP_IN, timeout=10 * TSCALE)
        if r.status_code != 200:
            return False, f"{r.status_code} {r.text[:200]}"
        body = r.json()
        got = np.array(body["predictions"], dtype=np.float64)
        assert got.shape == MLP_OUT.shape and np.allclose(got, MLP_OUT, rtol=0, atol=1e-5), body
        return body["version"] == version, f"version {body['version']}"

    return cond


def answers(status, method, path, **kw):
    def cond(s):
        r = s.request(method, path, timeout=10 * TSCALE, **kw)
        return r.status_code == status, f"{r.status_code} {r.text[:200]}"

    return cond


@pytest.mark.parametrize("n", [2, 3])
def test_changes_through_nginx_reach_every_replica(fleet, n):
    f = fleet(n)
    v1 = created(f.deploy())
    assert v1["version"] == 1 and v1["default"] is True, v1
    f.each("every replica serves version 1", serves(1))

    # a new default through nginx: every replica moves to it
    v2 = created(f.deploy())
    assert v2["version"] == 2 and v2["default"] is True, v2
    f.each("every replica serves version 2", serves(2))

    # a default change (a rollback) through nginx
    r = requests.patch(f.url + "/models/m", json={"default_version": 1}, timeout=30 * TSCALE)
    assert r.status_code == 200, r.text
    f.each("every replica is back on version 1", serves(1))
    # through nginx, whichever replica answers, the model reads the same
    for _ in range(2 * n):
        m = requests.get(f.url + "/models/m", timeout=10 * TSCALE).json()
        assert m["default_version"] == 1 and [v["version"] for v in m["versions"]] == [1, 2], m

    # a version's delete through nginx: no replica serves or lists it
    f.each("every replica serves version 2 by number", serves(2, "/models/m/versions/2/predict"))
    r = requests.delete(f.url + "/models/m/versions/2", timeout=30 * TSCALE)
    assert r.status_code in (200, 204), r.text
    f.each("no replica lists version 2", answers(404, "GET", "/models/m/versions/2"))
    f.each("no replica serves version 2",
           answers(404, "POST", "/models/m/versions/2/predict", json=MLP_IN))
    f.each("every replica still serves version 1", serves(1))

    # the model's delete through nginx: gone everywhere
    r = requests.delete(f.url + "/models/m", timeout=30 * TSCALE)
    assert r.status_code in (200, 204), r.text
    f.each("no replica serves m", answers(404, "POST", "/models/m/predict", json=MLP_IN))
    f.each("no replica lists m", answers(404, "GET", "/models/m"))


@pytest.mark.parametrize("n", [2, 3])
def test_concurrent_deploys_through_nginx(fleet, n):
    """n clients each deploy `per` versions of one name through nginx at once
    (each a new default, as a plain upload is): the numbers are exactly
    1..n*per, one is the default, and every replica serves that one."""
    f = fleet(n)
    per = 4
    got, errors = [], []
    barrier = threading.Barrier(n)

    def client():
        barrier.wait()
        for _ in range(per):
            try:
                r = f.deploy()
            except requests.RequestException as e:
                errors.append(repr(e))
                return
            if r.status_code != 201:
                errors.append((r.status_code, r.text))
                return
            got.append(r.json()["version"])

    ts = [threading.Thread(target=client) for _ in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(300 * TSCALE)
    assert not any(t.is_alive() for t in ts), "a deploy is stuck"
    assert not errors, errors
    assert sorted(got) == list(range(1, n * per + 1)), sorted(got)

    m = requests.get(f.url + "/models/m", timeout=10 * TSCALE).json()
    assert [v["version"] for v in m["versions"]] == list(range(1, n * per + 1)), m
    assert sum(1 for v in m["versions"] if v["default"]) == 1, m
    default = m["default_version"]
    f.each(f"every replica lists 1..{n * per} with default {default}",
           lambda s: (lambda mm: (mm["default_version"] == default
                                  and [v["version"] for v in mm["versions"]]
                                  == list(range(1, n * per + 1)), mm["default_version"]))(
               s.get("/models/m").json()))
    f.each(f"every replica serves the default, version {default}", serves(default))


@pytest.mark.parametrize("mode", ["fast", "immediate"])
def test_postgresql_down_behind_nginx(fleet, pg_cluster, mode):
    """PostgreSQL stopped under two replicas: through nginx predictions keep
    answering and a deploy answers 503 index_unavailable with Retry-After;
    every replica stays ready (in rotation). Started again, a deploy through
    nginx succeeds with the next number and every replica serves it."""
    f = fleet(2)
    created(f.deploy())
    f.each("every replica serves version 1", serves(1))
    pg_cluster.stop(mode)
    try:
        for _ in range(10):
            r = requests.post(f.url + "/models/m/predict", json=MLP_IN, timeout=10 * TSCALE)
            assert r.status_code == 200 and r.json()["version"] == 1, r.text
        r = f.deploy()
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "index_unavailable", r.text
        assert r.headers.get("Retry-After"), r.headers
        for s in f.replicas:
            assert s.get("/readyz").status_code == 200, s.port
            assert serves(1)(s)[0], s.port
    finally:
        pg_cluster.start()
    deadline = time.monotonic() + CONVERGE_S * TSCALE
    while True:
        r = f.deploy()
        if r.status_code != 503 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert created(r)["version"] == 2, r.text
    f.each("every replica serves version 2 after the restart", serves(2))
