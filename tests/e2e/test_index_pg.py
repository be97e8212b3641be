"""
test_index_pg.py - the index in PostgreSQL 15 (index_url, issue 25), against
the real binary and a real PostgreSQL cluster (pg.py: a throwaway cluster,
a fresh database per test):

- deploy, list, get, the default, retention, delete and a batch job work
  with --index-url, and the rows are in PostgreSQL (not in index.sqlite);
- two replicas on one database (and, for now, one --store directory for the
  blobs) each deploying N versions of one name at once get exactly 1..2N,
  one first default; an explicit duplicate number is 409;
- PostgreSQL restarted (fast and immediate) during deploys and predictions:
  loaded models keep answering, writes answer 503 index_unavailable with
  Retry-After while it is down, nothing is half-applied (the versions are
  1..K with no gap: a failed deploy allocated nothing), and the replica
  reconnects by itself.

No test waits on a clock for ordering: everything polls with a deadline.
"""
import json
import threading
import time

import pytest
import requests

from conftest import REPO, TSCALE

FIXTURES = REPO / "tests" / "fixtures"
MLP = (FIXTURES / "mlp.pt").read_bytes()
CNN = (FIXTURES / "cnn.pt").read_bytes()
MLP_CONFIG = {"input": {"shape": [4]}, "output": "logits"}
MLP_IN = json.loads((FIXTURES / "mlp_input.json").read_text())


def upload(srv, name, data=MLP, config=MLP_CONFIG, timeout=30, **fields):
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
            last_ok = False
        else:
            last_ok = bool(last)
        if last_ok:
            return last
        time.sleep(0.02)
    pytest.fail(f"{what}: not within {timeout * TSCALE:.0f} s (last: {last!r})")


def pg_start(start_server, pg_url, *args, store=None):
    return start_server("--index-url", pg_url, "--store-poll-ms", "50", *args, store=store)


def db_of(url):
    return url.rsplit("/", 1)[1]


def versions_in_db(pg_cluster, pg_url, name):
    out = pg_cluster.psql(f"SELECT version FROM versions WHERE model = '{name}' ORDER BY version",
                          db=db_of(pg_url))
    return [int(x) for x in out.split()] if out else []


def predict_ok(srv, name="m"):
    r = srv.request("POST", f"/models/{name}/predict", json=MLP_IN, timeout=10 * TSCALE)
    return r.status_code == 200, r


# ------------------------------------------------------------ the basics


def test_store_operations_on_postgresql(start_server, pg_cluster, pg_url, tmp_path):
    srv = pg_start(start_server, pg_url, "--allowed-paths", str(tmp_path))
    assert not (srv.store / "index.sqlite").exists(), "the index went to SQLite"
    v1 = created(upload(srv, "m"))
    assert v1["version"] == 1 and v1["default"] is True, v1
    v2 = created(upload(srv, "m", deploy="false"))
    assert v2["version"] == 2 and v2["default"] is False, v2
    assert versions_in_db(pg_cluster, pg_url, "m") == [1, 2]
    ok, r = predict_ok(srv)
    assert ok, r.text

    r = srv.get("/models")
    assert r.status_code == 200 and [m["name"] for m in r.json()["models"]] == ["m"], r.text
    m = srv.get("/models/m").json()
    assert m["default_version"] == 1 and [v["version"] for v in m["versions"]] == [1, 2], m

    # the default moves, and the replica's own sync agrees
    r = srv.request("PATCH", "/models/m", json={"default_version": 2})
    assert r.status_code == 200, r.text
    assert srv.get("/models/m").json()["default_version"] == 2

    # retention: keep_last 2 with a third version removes version 1
    created(upload(srv, "m", deploy="false"))
    r = srv.request("PATCH", "/models/m", json={"retention": {"keep_last": 2}})
    assert r.status_code == 200, r.text
    assert versions_in_db(pg_cluster, pg_url, "m") == [2, 3]

    # an explicit duplicate is 409; a number never comes back after a delete
    r = upload(srv, "m", version="3")
    assert r.status_code == 409 and code(r) == "version_exists", r.text
    r = srv.request("DELETE", "/models/m/versions/3")
    assert r.status_code in (200, 204), r.text
    assert created(upload(srv, "m", deploy="false"))["version"] == 4

    # a metric recorded after upload, ordering by it (JSON in C, not SQL)
    r = srv.get("/models/m/versions", params={"order_by": "created_at"})
    assert r.status_code == 200, r.text

    # a batch job: created, run, recorded in PostgreSQL
    csv = tmp_path / "rows.csv"
    csv.write_text("a,b,c,d\n" + "\n".join(",".join(str(x) for x in row) for row in MLP_IN) + "\n")
    r = srv.request("POST", "/jobs", json={"model": "m", "input": {"path": str(csv), "format": "csv"}})
    assert r.status_code == 202, r.text
    jid = r.json()["id"]
    job = poll(lambda: (lambda j: j if j["status"] in ("succeeded", "failed") else None)(
        srv.get(f"/jobs/{jid}").json()), "the job finishes", timeout=60)
    assert job["status"] == "succeeded", job
    assert job["rows_done"] == len(MLP_IN), job
    assert pg_cluster.psql(f"SELECT status FROM jobs WHERE id = '{jid}'", db=db_of(pg_url)) == "succeeded"

    # delete the model: rows gone from PostgreSQL
    r = srv.request("DELETE", "/models/m")
    assert r.status_code in (200, 204), r.text
    assert versions_in_db(pg_cluster, pg_url, "m") == []
    assert srv.get("/models/m").status_code == 404


def test_print_config_masks_the_password(run_modeld):
    p = run_modeld("--print-config", "--index-url",
                   "postgresql://modeld:hunter2@db.example:5432/modeld?sslmode=require")
    assert p.returncode == 0, p.stderr
    cfg = json.loads(p.stdout)
    assert "hunter2" not in p.stdout
    assert cfg["index_url"] == "postgresql://modeld:***@db.example:5432/modeld?sslmode=require"


def test_unreachable_index_at_start_names_no_password(run_modeld, tmp_path):
    p = run_modeld("--store", tmp_path / "s", "--port", "1",
                   "--index-url", "postgresql://modeld:hunter2@127.0.0.1:1/x?connect_timeout=2")
    assert p.returncode != 0
    assert "hunter2" not in p.stderr and "hunter2" not in p.stdout
    assert "cannot connect" in p.stderr, p.stderr


def test_unknown_index_scheme_is_refused(run_modeld, tmp_path):
    p = run_modeld("--store", tmp_path / "s", "--index-url", "mysql://u:hunter2@h/db")
    assert p.returncode != 0
    assert "unknown scheme" in p.stderr and "hunter2" not in p.stderr, p.stderr


# ------------------------------------------------------------ two replicas


def test_two_replicas_allocate_versions_in_the_database(start_server, pg_url, tmp_path):
    n = 8
    store = tmp_path / "shared-store"  # blobs shared on this host (blob_url is other work)
    a = pg_start(start_server, pg_url, store=store)
    b = pg_start(start_server, pg_url, store=store)
    got = {a.url: [], b.url: []}
    errors = []
    barrier = threading.Barrier(2)

    def deploy_n(srv, data):
        barrier.wait()
        for _ in range(n):
            r = upload(srv, "m", data=data, deploy="false", timeout=60)
            if r.status_code != 201:
                errors.append((srv.url, r.status_code, r.text))
                return
            got[srv.url].append(r.json()["version"])

    ts = [threading.Thread(target=deploy_n, args=(a, MLP)),
          threading.Thread(target=deploy_n, args=(b, MLP))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors
    allv = sorted(got[a.url] + got[b.url])
    assert allv == list(range(1, 2 * n + 1)), got
    for srv in (a, b):
        m = srv.get("/models/m").json()
        assert m["default_version"] == 1, m
        assert sum(1 for v in m["versions"] if v["default"]) == 1, m
    # an explicit duplicate through either replica is 409
    r = upload(b, "m", version=str(got[a.url][0]))
    assert r.status_code == 409 and code(r) == "version_exists", r.text
    # a change through one is seen by the other (the generation poll)
    r = a.request("PATCH", "/models/m", json={"default_version": 2 * n})
    assert r.status_code == 200, r.text
    poll(lambda: b.get("/models/m").json()["default_version"] == 2 * n, "replica b sees the default")


# ------------------------------------------------------------ PostgreSQL restarts


@pytest.mark.parametrize("mode", ["fast", "immediate"])
def test_postgresql_down_writes_503_reads_keep_serving(start_server, pg_cluster, pg_url, mode):
    srv = pg_start(start_server, pg_url)
    created(upload(srv, "m"))
    poll(lambda: predict_ok(srv)[0], "the model answers")

    pg_cluster.stop(mode)
    try:
        # writes: 503 index_unavailable with Retry-After, at once (no hang)
        r = upload(srv, "m", deploy="false")
        assert r.status_code == 503, r.text
        assert code(r) == "index_unavailable", r.text
        assert r.headers.get("Retry-After"), r.headers
        assert "password" not in r.text
        r = srv.request("PATCH", "/models/m", json={"retention": {"keep_last": 3}})
        assert r.status_code == 503 and code(r) == "index_unavailable", r.text
        # the loaded model keeps answering, repeatedly
        for _ in range(20):
            ok, r = predict_ok(srv)
            assert ok, f"prediction failed while PostgreSQL was down: {r.status_code} {r.text!r}"
        # health stays up (the predict path does not need the index)
        assert srv.get("/healthz").status_code == 200
        # the scrape says the index is down, and reports no store gauge as 0
        text = srv.get("/metrics").text
        assert "\nmodeld_index_up 0\n" in text, text[:2000]
        for gone in ("modeld_store_models ", "modeld_store_versions ", "modeld_jobs{",
                     "modeld_job_rows_done{"):
            assert gone not in text, f"{gone.strip()} reported while the index is down"
        assert "\nmodeld_http_requests_in_flight " in text  # the rest is there
    finally:
        pg_cluster.start()

    # the replica reconnects by itself: the next deploy (after at most a few
    # 503s while PostgreSQL finishes starting) gets version 2 - the failed
    # deploy allocated nothing
    r = poll(lambda: (lambda r: r if r.status_code != 503 else None)(upload(srv, "m", deploy="false")),
             "a deploy succeeds after the restart")
    assert created(r)["version"] == 2
    assert versions_in_db(pg_cluster, pg_url, "m") == [1, 2]
    ok, r = predict_ok(srv)
    assert ok, r.text
    text = srv.get("/metrics").text
    assert "\nmodeld_index_up 1\n" in text and "\nmodeld_store_versions 2\n" in text


@pytest.mark.parametrize("mode", ["fast", "immediate"])
def test_restart_during_deploys_nothing_half_applied(start_server, pg_cluster, pg_url, mode):
    srv = pg_start(start_server, pg_url)
    created(upload(srv, "m"))
    poll(lambda: predict_ok(srv)[0], "the model answers")
    stop = threading.Event()
    answers = []
    predict_failures = []

    def deployer():
        while not stop.is_set():
            try:
                r = upload(srv, "m", deploy="false", timeout=60)
                answers.append((r.status_code, r.json().get("version") if r.status_code == 201
                                else r.json()["error"]["code"]))
            except requests.RequestException as e:
                answers.append((0, repr(e)))

    def predictor():
        while not stop.is_set():
            ok, r = predict_ok(srv)
            if not ok:
                predict_failures.append((r.status_code, r.text))

    ts = [threading.Thread(target=deployer), threading.Thread(target=predictor)]
    for t in ts:
        t.start()
    try:
        poll(lambda: sum(1 for s, _ in answers if s == 201) >= 2, "deploys before the restart")
        pg_cluster.stop(mode)
        poll(lambda: any(s == 503 for s, _ in answers), "a deploy answers 503 while down")
        pg_cluster.start()
        seen = len(answers)
        poll(lambda: any(s == 201 for s, _ in answers[seen:]), "deploys succeed again")
    finally:
        stop.set()
        for t in ts:
            t.join(120)
    assert not predict_failures, predict_failures[:3]
    bad = [a for a in answers if a[0] not in (201, 503)]
    assert not bad, bad
    assert all(c == "index_unavailable" for s, c in answers if s == 503), answers
    ok201 = sorted(v for s, v in answers if s == 201)
    n503 = sum(1 for s, _ in answers if s == 503)
    inDB = versions_in_db(pg_cluster, pg_url, "m")
    # no gap, no duplicate: every committed row is whole and numbered in turn
    assert inDB == list(range(1, len(inDB) + 1)), inDB
    assert set(ok201) <= set(inDB), (ok201, inDB)
    # a 503 may only hide a commit whose answer was lost with the connection
    assert len(ok201) + 1 <= len(inDB) <= len(ok201) + 1 + n503, (ok201, inDB, n503)
    # every row's blob is there
    for v in srv.get("/models/m").json()["versions"]:
        assert (srv.store / "blobs" / v["sha256"]).exists(), v


# ------------------------------------------------------------ LISTEN/NOTIFY


def test_change_reaches_the_other_replica_by_notify(start_server, pg_cluster, pg_url, tmp_path):
    """With the generation poll all but off (60 s), a new default through
    replica A is served by replica B because PostgreSQL notified it; after a
    restart of PostgreSQL B listens again by itself."""
    store = tmp_path / "shared-store"
    a = start_server("--index-url", pg_url, "--store-poll-ms", "60000", store=store)
    b = start_server("--index-url", pg_url, "--store-poll-ms", "60000", store=store)
    created(upload(a, "m"))
    poll(lambda: predict_ok(b)[0], "replica b serves m")  # loads version 1 on b
    waits = []
    for version in (2, 3):
        t0 = time.monotonic()
        assert created(upload(a, "m"))["version"] == version
        poll(lambda: b.get(f"/models/m/versions/{version}").json().get("loaded") is True,
             f"replica b loads version {version} without its poll", timeout=20)
        waits.append(time.monotonic() - t0)
    print(f"NOTIFY convergence (deploy answered + load on b): {[round(w, 3) for w in waits]} s")
    pg_cluster.restart("fast")
    r = poll(lambda: (lambda r: r if r.status_code != 503 else None)(upload(a, "m")),
             "a deploy succeeds after the restart")
    assert created(r)["version"] == 4
    poll(lambda: b.get("/models/m/versions/4").json().get("loaded") is True,
         "replica b loads version 4 after re-listening", timeout=20)
