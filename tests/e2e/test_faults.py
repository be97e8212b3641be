"""
test_faults.py - the real binary under faults: killed at random moments while
deploying, a full disk, a corrupt blob, a model that throws for some inputs.
`make faults` runs this file alone; `make test` runs it with the rest.

No assertion depends on when a fault lands: a kill is placed at a random
moment (a seeded generator, so a failure can be replayed), and what is checked
afterwards -- every acknowledged deploy is there, the index and the blob files
agree, no temp file is left -- must hold whatever the moment was.
"""
import json
import os
import random
import sqlite3
import subprocess
import threading
import time

import pytest
import requests

from conftest import REPO, TSCALE
from test_jobs import fmnist  # noqa: F401 (the session fixture: FashionMNIST converted once)

FIXTURES = REPO / "tests" / "fixtures"
MODELS = [  # (file, config) pairs a deploy cycles through: different bytes, same store
    (FIXTURES / "mlp.pt", {"input": {"shape": [4]}}),
    (FIXTURES / "cnn.pt", {"input": {"shape": [1, 8, 8]}}),
    (FIXTURES / "throws.pt", {"input": {"shape": [4]}}),
]


def upload(srv, name, path, config, timeout=30, **fields):
    data = {"config": json.dumps(config)}
    data.update({k: json.dumps(v) for k, v in fields.items()})
    with open(path, "rb") as f:
        return requests.post(srv.url + f"/models/{name}/versions", files={"checkpoint": f},
                             data=data, timeout=timeout * TSCALE)


def store_agrees_with_blobs(store):
    """The index and the blob files agree: every row's blob exists, no blob is
    an orphan, no temp file is left, and SQLite finds its file intact."""
    db = sqlite3.connect(f"file:{store / 'index.sqlite'}?mode=ro", uri=True)
    try:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        shas = {r[0] for r in db.execute("SELECT sha256 FROM versions")}
    finally:
        db.close()
    blobs = {p.name for p in (store / "blobs").iterdir()}
    assert shas <= blobs, f"rows without their blob: {sorted(shas - blobs)}"
    assert blobs <= shas, f"orphan blobs (no row): {sorted(blobs - shas)}"
    left = sorted(p.name for p in (store / "tmp").iterdir())
    assert left == [], f"temp files left after a restart: {left}"


def test_kill9_during_deploys_keeps_every_acknowledged_one(start_server, tmp_path):
    """50 deploys, the process killed with SIGKILL at a random moment of every
    5th: after each restart every deploy that was answered 201 is there and
    ready, and the index and the blobs agree. The kill waits for a random
    number of the round's deploys (0 to 3) to be answered first, then a
    random moment more, so deploys are acknowledged and cut on any machine,
    however fast (a fixed delay alone acknowledged none on a loaded one)."""
    rng = random.Random(20261123)
    store = tmp_path / "store"
    acked = {}  # version -> sha256 of every deploy answered 201
    for rnd in range(10):
        srv = start_server(store=store)
        store_agrees_with_blobs(store)  # what the last kill left, after the start's sweep

        answered = threading.Semaphore(0)  # one release per answered deploy of this round

        def deploy_five():
            for j in range(5):
                path, config = MODELS[(rnd + j) % len(MODELS)]
                try:
                    r = upload(srv, "m", path, config, metadata={"round": rnd, "j": j})
                except requests.RequestException:
                    return  # killed mid-request: not acknowledged
                if r.status_code == 201:
                    acked[r.json()["version"]] = r.json()["sha256"]
                else:
                    assert r.status_code >= 500 or r.status_code == 409, r.text
                answered.release()

        t = threading.Thread(target=deploy_five)
        t.start()
        for _ in range(rng.randint(0, 3)):
            assert answered.acquire(timeout=60 * TSCALE), "a deploy did not answer"
        time.sleep(rng.uniform(0, 0.2) * TSCALE)
        srv.proc.kill()
        srv.proc.wait(10)
        t.join(60 * TSCALE)
        assert not t.is_alive()
    srv = start_server(store=store)
    store_agrees_with_blobs(store)
    r = srv.get("/models/m/versions")
    assert r.status_code == 200, r.text
    stored = {v["version"]: v for v in r.json()["versions"]}
    missing = sorted(set(acked) - set(stored))
    assert not missing, f"acknowledged deploys lost by a kill: {missing}"
    for ver, sha in acked.items():
        assert stored[ver]["sha256"] == sha, stored[ver]
        assert stored[ver]["state"] == "ready", stored[ver]
    # and the default still answers
    r = srv.request("POST", "/models/m/predict", data="[[1, 2, 3, 4]]")
    assert r.status_code in (200, 400), r.text  # 400: the default takes another shape
    print(f"{len(acked)} of 50 deploys acknowledged before their kill, all kept")


@pytest.fixture
def small_fs(tmp_path):
    """A 4 MiB tmpfs (needs root, as CI has); unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], check=True)
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_disk_full_during_upload_answers_507(start_server, small_fs):
    srv = start_server(store=small_fs / "store")
    r = upload(srv, "m", *MODELS[0])
    assert r.status_code == 201, r.text
    big = small_fs.parent / "big.pt"
    big.write_bytes(os.urandom(6 * 1024 * 1024))  # more than the filesystem holds
    with open(big, "rb") as f:
        r = requests.post(srv.url + "/models/m/versions", files={"checkpoint": f},
                          timeout=30 * TSCALE)
    assert r.status_code == 507, r.text
    err = r.json()["error"]
    assert err["code"] == "insufficient_storage" and "free space" in err["message"], err
    # nothing half-written: no temp file, no new version, the blobs as before
    deadline = time.monotonic() + 5 * TSCALE
    while list((small_fs / "store" / "tmp").iterdir()) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert list((small_fs / "store" / "tmp").iterdir()) == []
    assert [v["version"] for v in srv.get("/models/m/versions").json()["versions"]] == [1]
    # serving goes on, and a deploy that fits still works once space is back
    r = srv.request("POST", "/models/m/predict", data="[[1, 2, 3, 4]]")
    assert r.status_code == 200, r.text
    r = upload(srv, "m", *MODELS[1])
    assert r.status_code == 201, r.text
    store_agrees_with_blobs(small_fs / "store")


def test_corrupt_blob_fails_that_version_only(start_server, tmp_path):
    srv = start_server()
    assert upload(srv, "a", *MODELS[0]).status_code == 201
    assert upload(srv, "b", *MODELS[1]).status_code == 201
    sha_a = srv.get("/models/a/versions/1").json()["sha256"]
    assert srv.stop() == 0, srv.stderr
    blob = tmp_path / "store" / "blobs" / sha_a
    blob.write_bytes(blob.read_bytes()[: blob.stat().st_size // 2])  # truncated on disk
    srv = start_server()
    assert srv.get("/readyz").status_code == 200  # one bad model does not hold the server
    va = srv.get("/models/a/versions/1").json()
    assert va["state"] == "failed", va
    r = srv.request("POST", "/models/a/predict", data="[[1, 2, 3, 4]]")
    assert r.status_code in (409, 422, 503), r.text
    assert r.json()["error"]["message"], r.text
    r = srv.request("POST", "/models/b/predict", data=json.dumps([[[0.5] * 8] * 8]))
    assert r.status_code == 200, r.text


def test_model_that_throws_fails_only_those_requests(start_server):
    """throws.pt raises when a row's first value is negative. Requests sent at
    once land in shared batches (max_delay); each bad one fails with the
    model's own reason, every good one is answered."""
    srv = start_server()
    config = {"input": {"shape": [4]}, "workers": 1,
              "batching": {"max_batch_size": 16, "max_delay_us": 20000}}
    assert upload(srv, "t", FIXTURES / "throws.pt", config).status_code == 201

    def one(i):
        row = [-1.0 if i % 5 == 2 else float(i), 1.0, 2.0, 3.0]
        r = requests.post(srv.url + "/models/t/predict", data=json.dumps([row]),
                          timeout=30 * TSCALE)
        return i, row, r.status_code, r.json()

    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(16) as ex:
        results = list(ex.map(one, range(40)))
    for i, row, status, body in results:
        if row[0] < 0:
            assert status == 422, (i, status, body)
            assert "ValueError: a row's first value is negative" in body["error"]["message"], body
        else:
            assert status == 200, (i, status, body)
            assert body["predictions"] == [[2 * v for v in row]], (i, body)
    stats = srv.get("/models/t").json()
    assert srv.proc.poll() is None, srv.stderr
    print("batches:", json.dumps(stats.get("loaded", stats))[:300])


def test_kill9_at_random_moments_of_a_job(start_server, fmnist, tmp_path):
    """SIGKILL at five random moments (seeded) of one job over the 10k
    FashionMNIST test set, restarting each time: the job ends with every row
    exactly once, in order, and PyTorch's accuracy, wherever the kills landed
    (before it started, mid-chunk, between chunks, after it finished)."""
    from test_jobs import (assert_accuracy, assert_done, assert_full_jsonl, create_job,
                           deploy_fashion, idx_input, jsonl_rows, output, server_args, wait_job)
    rng = random.Random(11)
    args = server_args(fmnist, tmp_path)
    srv = start_server(*args)
    deploy_fashion(srv)
    jid = create_job(srv, {"model": "fashion", "input": idx_input(), "batch_size": 16,
                           "output": {"format": "jsonl"}})
    for _ in range(5):
        time.sleep(rng.uniform(0, 0.3) * TSCALE)
        srv.proc.kill()
        srv.proc.wait(10)
        srv.kill()
        srv = start_server(*args)  # the same store: the job resumes
    job = wait_job(srv, jid)
    assert_done(job)
    assert_accuracy(job, fmnist)
    rows = jsonl_rows(output(srv, jid))
    idx = [row["index"] for row in rows]
    assert len(idx) == len(set(idx)), f"rows written twice: {len(idx) - len(set(idx))}"
    assert_full_jsonl(rows, fmnist)
