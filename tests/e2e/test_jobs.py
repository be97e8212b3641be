"""
test_jobs.py - batch jobs end to end: POST /jobs over the FashionMNIST test
set in every input format (IDX, CSV, JSONL, NPY, N-D NPY, a URL), every output
format (JSONL, CSV, NPY), malformed rows, validation, listing, cancellation,
kill -9 and SIGTERM in the middle of a job, and a job beside online traffic.

The expected accuracy is the one PyTorch itself computed for
examples/fashion_mnist/model.pt on the same 10,000 images
(examples/fashion_mnist/metrics.json, written by train.py): the server must
get exactly that many right. torch is not needed here.

Tests that act in the middle of a job (kill, SIGTERM, cancel, a replica taking
over) run it paced with the test-only --test-job-chunk-delay-ms (PACED): every
chunk is committed and followed by a pause, so "the middle" is a state that
lasts for many chunks on any machine, not a race against its speed.

The dataset conversion (IDX.gz -> CSV, NPY, N-D float32 NPY, JSONL) is
`convert_fashion_mnist` below, run once per session by the `fmnist` fixture.
"""
import csv
import gzip
import io
import json
import os
import signal
import sqlite3
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import requests

from conftest import REPO, TSCALE
from loopback import LoopbackServer, send_file

EXAMPLE = REPO / "examples" / "fashion_mnist"
FASHION_PT = EXAMPLE / "model.pt"
FASHION_JSON = EXAMPLE / "model.json"
METRICS_JSON = EXAMPLE / "metrics.json"
DATASETS = Path("/usr/share/datasets")
FMNIST = DATASETS / "fashion-mnist"
IMAGES_GZ = FMNIST / "t10k-images-idx3-ubyte.gz"
LABELS_GZ = FMNIST / "t10k-labels-idx1-ubyte.gz"
N = 10000
JOB_TIMEOUT = 120.0
TERMINAL = ("succeeded", "failed", "cancelled")


# ------------------------------------------------------------ the fixture script


def read_idx_gz(path):
    """An IDX file (the MNIST family, gzip) as a uint8 numpy array of its dims."""
    with gzip.open(path, "rb") as f:
        data = f.read()
    assert data[0:2] == b"\0\0" and data[2] == 0x08, f"{path}: not an unsigned-byte IDX file"
    ndim = data[3]
    dims = struct.unpack(">" + "I" * ndim, data[4:4 + 4 * ndim])
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def convert_fashion_mnist(out_dir, images_gz=IMAGES_GZ, labels_gz=LABELS_GZ):
    """Write the FashionMNIST test set into `out_dir` as
         test.csv      header p0..p783,label; raw 0..255 integers
         test.npy      uint8 [N, 784]
         test_f32.npy  float32 [N, 1, 28, 28], raw 0..255
         test.jsonl    {"features": [784 ints], "label": y} per line
    and return a namespace with the paths, the images and the labels."""
    out_dir = Path(out_dir)
    images = read_idx_gz(images_gz)
    labels = read_idx_gz(labels_gz).astype(np.int64)
    assert images.shape[0] == labels.shape[0]
    n = images.shape[0]
    flat = images.reshape(n, -1)
    width = flat.shape[1]
    columns = [f"p{i}" for i in range(width)]

    csv_path = out_dir / "test.csv"
    np.savetxt(csv_path, np.hstack([flat.astype(np.int64), labels[:, None]]), fmt="%d",
               delimiter=",", header=",".join(columns + ["label"]), comments="")
    npy_path = out_dir / "test.npy"
    np.save(npy_path, np.ascontiguousarray(flat, dtype=np.uint8))
    f32_path = out_dir / "test_f32.npy"
    np.save(f32_path, flat.reshape(n, 1, 28, 28).astype(np.float32))
    jsonl_path = out_dir / "test.jsonl"
    with open(jsonl_path, "w") as f:
        for row, y in zip(flat.tolist(), labels.tolist()):
            f.write(json.dumps({"features": row, "label": y}, separators=(",", ":")) + "\n")
    return SimpleNamespace(dir=out_dir, csv=csv_path, npy=npy_path, npy_f32=f32_path,
                           jsonl=jsonl_path, images=flat, labels=labels, columns=columns)


@pytest.fixture(scope="session")
def fmnist(tmp_path_factory):
    if not IMAGES_GZ.exists() or not LABELS_GZ.exists():
        pytest.fail(f"the FashionMNIST test set is missing under {FMNIST}")
    d = convert_fashion_mnist(tmp_path_factory.mktemp("fmnist"))
    d.class_names = json.loads(FASHION_JSON.read_text())["labels"]
    d.accuracy = json.loads(METRICS_JSON.read_text())["accuracy"]
    d.correct = round(d.accuracy * N)
    assert d.correct == 8675, f"metrics.json accuracy {d.accuracy} is not 8675/10000"
    return d


# ------------------------------------------------------------ helpers


def server_args(fmnist, tmp_path):
    return ("--allowed-paths", f"{fmnist.dir},{tmp_path},{DATASETS}")


# For tests only: the server commits after every job chunk and then pauses this
# long, so "the middle of a job" lasts (chunks x PACE_MS) however fast the
# machine is, and a kill, SIGTERM or cancel lands there for certain.
PACE_MS = 200
PACED = ("--test-job-chunk-delay-ms", str(PACE_MS))


def deploy_fashion(srv):
    with open(FASHION_PT, "rb") as f:
        r = requests.post(srv.url + "/models/fashion/versions", files={"checkpoint": f},
                          data={"config": FASHION_JSON.read_text()}, timeout=30 * TSCALE)
    assert r.status_code == 201, f"deploy fashion: expected 201, got {r.status_code}: {r.text!r}"
    return r.json()


@pytest.fixture
def paced(start_server, fmnist, tmp_path):
    """Like `fashion`, with every job paced (PACED): each committed chunk is
    followed by a PACE_MS pause, so a job of many chunks is reliably mid-way."""
    srv = start_server(*server_args(fmnist, tmp_path), *PACED)
    deploy_fashion(srv)
    return srv


@pytest.fixture
def fashion(start_server, fmnist, tmp_path):
    """A server allowed to read the converted data, tmp_path and /usr/share/datasets,
    with examples/fashion_mnist deployed as model "fashion"."""
    srv = start_server(*server_args(fmnist, tmp_path))
    deploy_fashion(srv)
    return srv


def idx_input():
    return {"path": str(IMAGES_GZ), "format": "idx", "label": str(LABELS_GZ)}


def post_job(srv, spec):
    return srv.request("POST", "/jobs", json=spec, timeout=10 * TSCALE)


def create_job(srv, spec):
    r = post_job(srv, spec)
    assert r.status_code == 202, f"POST /jobs {spec}: expected 202, got {r.status_code}: {r.text!r}"
    body = r.json()
    jid = body.get("id")
    assert isinstance(jid, str) and jid, f"POST /jobs: no id in {body}"
    assert body.get("status") == "queued", f"POST /jobs: {body}"
    assert r.headers.get("Location") == f"/jobs/{jid}", \
        f"POST /jobs: Location {r.headers.get('Location')!r}, expected /jobs/{jid}"
    return jid


def get_job(srv, jid):
    r = srv.get(f"/jobs/{jid}")
    assert r.status_code == 200, f"GET /jobs/{jid}: {r.status_code} {r.text!r}"
    return r.json()


def wait_job(srv, jid, want="succeeded", timeout=JOB_TIMEOUT):
    deadline = time.monotonic() + timeout * TSCALE
    while True:
        job = get_job(srv, jid)
        if job["status"] in TERMINAL:
            break
        assert time.monotonic() < deadline, \
            f"job {jid} still {job['status']} after {timeout * TSCALE:.0f} s: {job}"
        time.sleep(0.05)
    assert job["status"] == want, f"job {jid}: expected status {want}, got {job}\n" \
                                  f"server stderr:\n{srv.stderr[-3000:]}"
    return job


def wait_rows(srv, jid, at_least=1, timeout=JOB_TIMEOUT, interval=0.003):
    """Poll quickly until rows_done >= at_least; returns the job."""
    deadline = time.monotonic() + timeout * TSCALE
    while True:
        job = get_job(srv, jid)
        if job["rows_done"] >= at_least or job["status"] in TERMINAL:
            return job
        assert time.monotonic() < deadline, f"job {jid} made no progress: {job}"
        time.sleep(interval)


def output(srv, jid, content_type=None):
    r = srv.get(f"/jobs/{jid}/output", timeout=30 * TSCALE)
    assert r.status_code == 200, f"GET /jobs/{jid}/output: {r.status_code} {r.text[:500]!r}"
    if content_type:
        assert r.headers.get("Content-Type", "").startswith(content_type), \
            f"GET /jobs/{jid}/output: Content-Type {r.headers.get('Content-Type')!r}, " \
            f"expected {content_type}"
    return r


def jsonl_rows(r):
    text = r.text
    assert text == "" or text.endswith("\n"), f"output does not end with a newline: {text[-200:]!r}"
    return [json.loads(line) for line in text.splitlines()]


def assert_accuracy(job, fmnist, n=N):
    assert job["labeled"] == n, f"labeled {job['labeled']}, expected {n}: {job}"
    assert job["correct"] == fmnist.correct, \
        f"correct {job['correct']}, expected {fmnist.correct} (PyTorch's count): {job}"
    assert "accuracy" in job, f"no accuracy in {job}"
    assert job["accuracy"] == pytest.approx(fmnist.accuracy, abs=1e-9), \
        f"accuracy {job['accuracy']}, expected {fmnist.accuracy}"


def assert_done(job, n=N):
    assert job["rows_done"] == n, f"rows_done {job['rows_done']}, expected {n}: {job}"
    assert job["rows_total"] == n, f"rows_total {job['rows_total']}, expected {n}: {job}"
    assert job["rows_skipped"] == 0, job
    assert job["partial"] is False, job
    assert job["error"] is None, job
    assert job["finished_at"], job


def assert_full_jsonl(rows, fmnist):
    """10,000 rows, index 0..N-1 in order, a class name per row, the right label,
    and exactly PyTorch's number of right answers."""
    assert len(rows) == N, f"{len(rows)} output lines, expected {N}"
    idx = [row.get("index") for row in rows]
    if idx != list(range(N)):
        bad = next(i for i, v in enumerate(idx) if v != i)
        pytest.fail(f"output index out of order at line {bad}: {idx[max(0, bad - 3):bad + 3]}")
    right = 0
    for i, row in enumerate(rows):
        assert row.get("prediction") in fmnist.class_names, f"line {i}: {row}"
        assert row.get("label") == int(fmnist.labels[i]), f"line {i}: {row}"
        right += fmnist.class_names.index(row["prediction"]) == row["label"]
    assert right == fmnist.correct, f"{right} right predictions in the output, expected {fmnist.correct}"


def err_code(r):
    try:
        return r.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None


def job_count(srv):
    r = srv.get("/jobs?limit=1000")
    assert r.status_code == 200, f"GET /jobs: {r.status_code} {r.text!r}"
    return len(r.json()["jobs"])


def write_small_csv(path, fmnist, rows=5, bad=None):
    """The first `rows` test images as a CSV with a label column; bad=(row, col, text)
    replaces one cell."""
    lines = [",".join(fmnist.columns + ["label"])]
    for i in range(rows):
        cells = [str(v) for v in fmnist.images[i].tolist()] + [str(int(fmnist.labels[i]))]
        if bad and bad[0] == i:
            cells[bad[1]] = bad[2]
        lines.append(",".join(cells))
    Path(path).write_text("\n".join(lines) + "\n")
    return str(path)


# ------------------------------------------------------------ formats


def test_idx_gz_job(fashion, fmnist):
    jid = create_job(fashion, {"model": "fashion", "input": idx_input()})
    job = wait_job(fashion, jid)
    assert_done(job)
    assert_accuracy(job, fmnist)
    assert job["version"] == 1, job
    assert job["model"] == "fashion", job
    assert job["output"] == f"/jobs/{jid}/output", job
    conf = np.array(job["confusion"])
    assert conf.shape == (10, 10), f"confusion {job['confusion']}"
    assert conf.sum() == N, f"confusion sums to {conf.sum()}"
    assert np.trace(conf) == fmnist.correct, f"confusion diagonal {np.trace(conf)}"
    # confusion[label][predicted]: a row sums to that label's count
    assert conf.sum(axis=1).tolist() == np.bincount(fmnist.labels, minlength=10).tolist(), conf

    rows = jsonl_rows(output(fashion, jid, "application/x-ndjson"))
    assert_full_jsonl(rows, fmnist)
    # the confusion matrix matches the rows written
    conf2 = np.zeros((10, 10), dtype=np.int64)
    for row in rows:
        conf2[row["label"], fmnist.class_names.index(row["prediction"])] += 1
    assert (conf2 == conf).all(), f"confusion {conf.tolist()} differs from the output's {conf2.tolist()}"


def check_csv_output(srv, jid, fmnist):
    r = output(srv, jid, "text/csv")
    lines = r.text.splitlines()
    assert lines and lines[0] == "index,prediction,label", f"CSV header {lines[:1]}"
    rows = list(csv.reader(io.StringIO(r.text)))[1:]
    assert len(rows) == N, f"{len(rows)} CSV rows, expected {N}"
    assert [int(row[0]) for row in rows] == list(range(N)), "CSV index not 0..N-1 in order"
    right = 0
    for i, (index, pred, label) in enumerate(rows):
        assert pred in fmnist.class_names, f"CSV row {i}: {(index, pred, label)}"
        assert int(label) == fmnist.labels[i], f"CSV row {i}: {(index, pred, label)}"
        right += fmnist.class_names.index(pred) == int(label)
    assert right == fmnist.correct


def test_csv_job(fashion, fmnist):
    jid = create_job(fashion, {"model": "fashion",
                               "input": {"path": str(fmnist.csv), "format": "csv", "label": "label"},
                               "output": {"format": "csv"}})
    jid2 = create_job(fashion, {"model": "fashion",
                                "input": {"path": str(fmnist.csv), "format": "csv",
                                          "features": fmnist.columns, "label": "label"}})
    job = wait_job(fashion, jid)
    assert_done(job)
    assert_accuracy(job, fmnist)
    check_csv_output(fashion, jid, fmnist)

    job2 = wait_job(fashion, jid2)
    assert_done(job2)
    assert_accuracy(job2, fmnist)
    assert_full_jsonl(jsonl_rows(output(fashion, jid2, "application/x-ndjson")), fmnist)


@pytest.mark.parametrize("which", ["npy", "npy_f32"])
def test_npy_job(fashion, fmnist, which):
    path = getattr(fmnist, which)
    jid = create_job(fashion, {"model": "fashion", "input": {"path": str(path), "format": "npy"},
                               "output": {"format": "npy"}})
    job = wait_job(fashion, jid)
    assert job["rows_done"] == N and job["rows_total"] == N, job
    assert job["labeled"] == 0 and "accuracy" not in job, f"NPY has no labels: {job}"
    r = output(fashion, jid, "application/x-npy")
    out = np.load(io.BytesIO(r.content))
    assert out.shape == (N, 10), f"output shape {out.shape}"
    assert out.dtype == np.float32, f"output dtype {out.dtype}"
    right = int((out.argmax(axis=1) == fmnist.labels).sum())
    assert right == fmnist.correct, f"{right}/{N} right from the NPY logits, expected {fmnist.correct}"


def test_jsonl_job(fashion, fmnist):
    jid = create_job(fashion, {"model": "fashion",
                               "input": {"path": str(fmnist.jsonl), "format": "jsonl",
                                         "label": "label"}})
    job = wait_job(fashion, jid)
    assert_done(job)
    assert_accuracy(job, fmnist)
    assert_full_jsonl(jsonl_rows(output(fashion, jid)), fmnist)


def test_url_input(start_server, fmnist, tmp_path):
    # the file server is on 127.0.0.1, which downloads refuse unless allowed
    fashion = start_server(*server_args(fmnist, tmp_path), "--allow-private-urls", "1")
    deploy_fashion(fashion)
    files = LoopbackServer(lambda h: send_file(h, fmnist.dir, h.path))
    try:
        url = files.url("/test.csv")
        jid = create_job(fashion, {"model": "fashion",
                                   "input": {"url": url, "format": "csv", "label": "label"}})
        job = wait_job(fashion, jid)
    finally:
        files.close()
    assert_done(job)
    assert_accuracy(job, fmnist)
    assert_full_jsonl(jsonl_rows(output(fashion, jid)), fmnist)


# ------------------------------------------------------------ malformed rows


def test_malformed_row_fails_the_job(fashion, fmnist, tmp_path):
    path = write_small_csv(tmp_path / "bad.csv", fmnist, bad=(2, 100, "abc"))
    jid = create_job(fashion, {"model": "fashion",
                               "input": {"path": path, "format": "csv", "label": "label"},
                               "on_error": "fail"})
    job = wait_job(fashion, jid, want="failed")
    msg = job["error"] or ""
    assert "row 2" in msg, f"error should name row 2 (0-based data row): {msg!r}"
    assert "abc" in msg or "p100" in msg, f"error should name the value or the column: {msg!r}"
    r = fashion.get(f"/jobs/{jid}/output")
    assert r.status_code == 409 and err_code(r) == "job_not_finished", \
        f"output of a failed job: {r.status_code} {r.text!r}"


def test_malformed_row_skipped(fashion, fmnist, tmp_path):
    path = write_small_csv(tmp_path / "bad.csv", fmnist, bad=(2, 100, "abc"))
    jid = create_job(fashion, {"model": "fashion",
                               "input": {"path": path, "format": "csv", "label": "label"},
                               "on_error": "skip", "batch_size": 2})
    job = wait_job(fashion, jid)
    assert job["rows_skipped"] == 1, job
    assert job["rows_done"] == 5, f"rows_done counts good and skipped rows: {job}"
    assert job["labeled"] == 4, job
    rows = jsonl_rows(output(fashion, jid))
    assert [row["index"] for row in rows] == [0, 1, 3, 4], rows
    assert [row["label"] for row in rows] == [int(fmnist.labels[i]) for i in (0, 1, 3, 4)], rows


# ------------------------------------------------------------ validation


def test_validation(fashion, fmnist, tmp_path):
    before = job_count(fashion)
    good_in = {"path": str(fmnist.csv), "format": "csv", "label": "label"}
    outside = str(EXAMPLE / "row.json")  # exists, but not under allowed_paths
    cases = [
        ("unknown top-level key", {"model": "fashion", "input": good_in, "bogus": 1},
         400, "unknown_field"),
        ("unknown input key", {"model": "fashion", "input": {**good_in, "colums": ["p0"]}},
         400, "unknown_field"),
        ("columns not an object", {"model": "fashion", "input": {**good_in, "columns": ["p0"]}},
         400, "invalid_job"),
        ("unknown output key", {"model": "fashion", "input": good_in, "output": {"fmt": "csv"}},
         400, "unknown_field"),
        ("missing model", {"input": good_in}, 400, "invalid_job"),
        ("unknown model", {"model": "nope", "input": good_in}, 404, "model_not_found"),
        ("missing input", {"model": "fashion"}, 400, "invalid_job"),
        ("bad input format", {"model": "fashion", "input": {**good_in, "format": "xml"}},
         400, "invalid_format"),
        ("bad output format", {"model": "fashion", "input": good_in, "output": {"format": "xml"}},
         400, "invalid_format"),
        ("input outside allowed_paths",
         {"model": "fashion", "input": {"path": outside, "format": "jsonl"}},
         400, "path_not_allowed"),
        ("labels file outside allowed_paths",
         {"model": "fashion", "input": {"path": str(IMAGES_GZ), "format": "idx", "label": outside}},
         400, "path_not_allowed"),
        ("nonexistent input",
         {"model": "fashion", "input": {**good_in, "path": str(fmnist.dir / "missing.csv")}},
         400, "input_not_found"),
        ("nonexistent labels file",
         {"model": "fashion", "input": {**idx_input(), "label": str(FMNIST / "missing.gz")}},
         400, "input_not_found"),
        ("both path and url",
         {"model": "fashion", "input": {**good_in, "url": "http://127.0.0.1:9/test.csv"}},
         400, "invalid_job"),
        ("neither path nor url", {"model": "fashion", "input": {"format": "csv"}},
         400, "invalid_job"),
        ("bad on_error", {"model": "fashion", "input": good_in, "on_error": "ignore"},
         400, "invalid_job"),
        ("batch_size 0", {"model": "fashion", "input": good_in, "batch_size": 0}, 400, "invalid_job"),
        ("batch_size -1", {"model": "fashion", "input": good_in, "batch_size": -1},
         400, "invalid_job"),
        ("batch_size string", {"model": "fashion", "input": good_in, "batch_size": "64"},
         400, "invalid_job"),
        ("batch_size float", {"model": "fashion", "input": good_in, "batch_size": 1.5},
         400, "invalid_job"),
        ("batch_size too big", {"model": "fashion", "input": good_in, "batch_size": 65537},
         400, "invalid_job"),
    ]
    failures = []
    for what, spec, status, code in cases:
        r = post_job(fashion, spec)
        if r.status_code != status or err_code(r) != code:
            failures.append(f"{what}: POST /jobs {json.dumps(spec)[:300]} -> {r.status_code} "
                            f"{r.text[:300]!r}; expected {status} {code}")
    r = fashion.request("POST", "/jobs", data=b"not json", headers={"Content-Type": "application/json"})
    if r.status_code != 400 or err_code(r) != "invalid_json":
        failures.append(f"non-JSON body -> {r.status_code} {r.text[:300]!r}; expected 400 invalid_json")
    assert not failures, "\n".join(failures)
    assert job_count(fashion) == before, "a rejected job was inserted"


# ------------------------------------------------------------ listing, 404, 409


def test_list_filters_and_not_found(paced, fmnist, tmp_path):
    fashion = paced
    small = write_small_csv(tmp_path / "small.csv", fmnist)
    bad = write_small_csv(tmp_path / "bad.csv", fmnist, bad=(2, 100, "abc"))
    spec = {"model": "fashion", "input": {"path": small, "format": "csv", "label": "label"}}
    ok1 = create_job(fashion, spec)
    wait_job(fashion, ok1)
    failed = create_job(fashion, {"model": "fashion",
                                  "input": {"path": bad, "format": "csv", "label": "label"}})
    wait_job(fashion, failed, want="failed")
    ok2 = create_job(fashion, spec)
    wait_job(fashion, ok2)

    # output while queued or running: 409 job_not_finished (a paced job of
    # 10,000 chunks cannot end before the test cancels it)
    slow = create_job(fashion, {"model": "fashion", "input": idx_input(), "batch_size": 1})
    r = fashion.get(f"/jobs/{slow}/output")
    st = get_job(fashion, slow)["status"]
    assert r.status_code == 409 and err_code(r) == "job_not_finished", \
        f"GET /jobs/{slow}/output while {st}: {r.status_code} {r.text!r}"
    assert st in ("queued", "running"), f"the batch_size 1 job ended too soon: {st}"

    r = fashion.get("/jobs?status=succeeded&model=fashion")
    assert r.status_code == 200, r.text
    body = r.json()
    assert [j["id"] for j in body["jobs"]] == [ok2, ok1], f"succeeded jobs, newest first: {body}"
    assert body["next"] is None, body
    assert all(j["status"] == "succeeded" and j["model"] == "fashion" for j in body["jobs"])

    r = fashion.get("/jobs?status=failed")
    assert [j["id"] for j in r.json()["jobs"]] == [failed], r.text
    r = fashion.get("/jobs?model=other")
    assert r.status_code == 200 and r.json()["jobs"] == [], r.text

    r = fashion.get("/jobs?limit=1")
    assert r.status_code == 200, r.text
    page = r.json()
    assert [j["id"] for j in page["jobs"]] == [slow], page
    assert page["next"] == slow, page
    seen = [slow]
    while page["next"]:
        r = fashion.get(f"/jobs?limit=1&before={page['next']}")
        assert r.status_code == 200, r.text
        page = r.json()
        seen += [j["id"] for j in page["jobs"]]
    assert seen == [slow, ok2, failed, ok1], f"paging with limit=1 gave {seen}"

    for path in ("/jobs/unknown", "/jobs/unknown/output"):
        r = fashion.get(path)
        assert r.status_code == 404 and err_code(r) == "job_not_found", f"GET {path}: {r.status_code} {r.text!r}"
    r = fashion.request("DELETE", "/jobs/unknown")
    assert r.status_code == 404 and err_code(r) == "job_not_found", f"DELETE: {r.status_code} {r.text!r}"

    r = fashion.get("/jobs?status=bogus")
    assert r.status_code == 400, r.text
    r = fashion.request("DELETE", f"/jobs/{slow}")
    assert r.status_code == 202, r.text


# ------------------------------------------------------------ cancel


def test_cancel(paced, fmnist):
    fashion = paced
    jid = create_job(fashion, {"model": "fashion", "input": idx_input(), "batch_size": 1})
    job = wait_rows(fashion, jid, at_least=3)
    assert job["status"] == "running", f"expected a running job: {job}"
    r = fashion.request("DELETE", f"/jobs/{jid}")
    assert r.status_code == 202, f"DELETE /jobs/{jid}: {r.status_code} {r.text!r}"
    assert r.json()["id"] == jid, r.text
    job = wait_job(fashion, jid, want="cancelled", timeout=30)
    assert job["partial"] is True, job
    assert job["finished_at"], job
    done = job["rows_done"]
    assert 0 < done < N, job

    r = output(fashion, jid)
    assert r.headers.get("X-Partial") == "true", f"X-Partial {r.headers.get('X-Partial')!r}"
    rows = jsonl_rows(r)
    assert 0 < len(rows) < N, f"{len(rows)} lines"
    assert [row["index"] for row in rows] == list(range(len(rows))), "partial output has gaps"
    assert len(rows) == done, f"{len(rows)} lines but rows_done {done}"
    for i, row in enumerate(rows):
        assert row["label"] == int(fmnist.labels[i]), row

    r = fashion.request("DELETE", f"/jobs/{jid}")
    assert r.status_code == 409 and err_code(r) == "job_finished", \
        f"second DELETE: {r.status_code} {r.text!r}"


def test_cancel_queued(paced, fmnist):
    fashion = paced
    # the default max_jobs is 2: two slow jobs hold both runners, the third waits
    slow = [create_job(fashion, {"model": "fashion", "input": idx_input(), "batch_size": 1})
            for _ in range(2)]
    for jid in slow:
        wait_rows(fashion, jid, at_least=1)
    queued = create_job(fashion, {"model": "fashion", "input": idx_input()})
    assert get_job(fashion, queued)["status"] == "queued"
    r = fashion.request("DELETE", f"/jobs/{queued}")
    assert r.status_code == 202, f"DELETE a queued job: {r.status_code} {r.text!r}"
    job = get_job(fashion, queued)
    assert job["status"] == "cancelled", f"a queued job is cancelled at once: {job}"
    assert job["rows_done"] == 0 and job["partial"] is False, job
    r = fashion.get(f"/jobs/{queued}/output")
    assert r.status_code == 404 and err_code(r) == "output_missing", \
        f"output of a job cancelled while queued: {r.status_code} {r.text!r}"
    for jid in slow:
        assert fashion.request("DELETE", f"/jobs/{jid}").status_code == 202
    for jid in slow:
        wait_job(fashion, jid, want="cancelled", timeout=30)


# ------------------------------------------------------------ restarts


def stored_job(store, jid):
    """The job's row in the store's SQLite file (the server is not running)."""
    con = sqlite3.connect(str(Path(store) / "index.sqlite"))
    try:
        con.row_factory = sqlite3.Row
        row = con.execute("SELECT * FROM jobs WHERE id = ?", (jid,)).fetchone()
    finally:
        con.close()
    assert row is not None, f"job {jid} is not in the store"
    return dict(row)


def restart_mid_job(start_server, fmnist, tmp_path, how):
    args = server_args(fmnist, tmp_path)
    srv = start_server(*args, *PACED)  # 625 chunks, each followed by a pause
    deploy_fashion(srv)
    jid = create_job(srv, {"model": "fashion", "input": idx_input(), "batch_size": 16,
                           "output": {"format": "jsonl"}})
    job = wait_rows(srv, jid, at_least=3 * 16)
    assert job["status"] == "running" and 0 < job["rows_done"] < N, \
        f"could not catch the job in the middle: {job}"
    stopped_at = job["rows_done"]
    t0 = time.monotonic()
    if how == "kill":
        srv.proc.kill()
        srv.proc.wait(10)
    else:
        rc = srv.stop(signal.SIGTERM)
        assert rc == 0, f"modeld exited with {rc} on SIGTERM; stderr:\n{srv.stderr[-3000:]}"
    exit_s = time.monotonic() - t0
    srv.kill()  # closes its stderr file
    stored = stored_job(srv.store, jid)
    partial = Path(stored["output_path"] + ".partial")
    print(f"{how}: exited in {exit_s:.2f} s; store says {stored['status']} rows_done "
          f"{stored['rows_done']} output_bytes {stored['output_bytes']}; "
          f".partial holds {partial.stat().st_size if partial.exists() else None} bytes")
    late_stop = None
    if how == "term" and not (stored["status"] == "running" and stored["rows_done"] < N):
        # "running jobs stop after their current chunk and stay running in the
        # store, so the next start resumes them" (jobs/jobs.h, md_jobs_stop)
        late_stop = \
            f"SIGTERM at rows_done {stopped_at}: modeld took {exit_s:.2f} s to exit and left " \
            f"the job {stored['status']} at rows_done {stored['rows_done']} of {N}; a running " \
            f"job should stop after its current chunk, not run to the end of the input"

    srv2 = start_server(*args)  # same tmp_path, so the same store; not paced
    first = get_job(srv2, jid)
    print(f"{how}: stopped at rows_done {stopped_at}; after the restart "
          f"{first['status']} at rows_done {first['rows_done']}")
    job = wait_job(srv2, jid)
    assert_done(job)
    assert_accuracy(job, fmnist)
    rows = jsonl_rows(output(srv2, jid))
    idx = [row["index"] for row in rows]
    assert len(idx) == len(set(idx)), f"duplicate rows after the restart: {len(idx) - len(set(idx))}"
    assert_full_jsonl(rows, fmnist)
    assert late_stop is None, late_stop


def test_kill9_mid_job_resumes(start_server, fmnist, tmp_path):
    restart_mid_job(start_server, fmnist, tmp_path, "kill")


def test_sigterm_mid_job_resumes(start_server, fmnist, tmp_path):
    restart_mid_job(start_server, fmnist, tmp_path, "term")


# ------------------------------------------------------------ beside online traffic


def test_job_and_online_traffic(fashion, fmnist):
    jid = create_job(fashion, {"model": "fashion", "input": idx_input(), "batch_size": 64})

    def one(i):
        with requests.Session() as s:
            row = fmnist.images[i].tolist()
            r = s.post(fashion.url + "/models/fashion/predict", json=[row], timeout=30 * TSCALE)
            return i, r.status_code, r.text

    running_seen = get_job(fashion, jid)["status"]
    with ThreadPoolExecutor(4) as ex:
        results = list(ex.map(one, range(200)))
    bad = [(i, st, text[:200]) for i, st, text in results if st != 200]
    assert not bad, f"{len(bad)} of 200 online predictions failed beside the job: {bad[:5]}"
    job = wait_job(fashion, jid)
    assert_done(job)
    assert_accuracy(job, fmnist)
    rows = jsonl_rows(output(fashion, jid))
    assert_full_jsonl(rows, fmnist)
    # the online answers agree with the job's for the same images
    for i, _, text in results:
        body = json.loads(text)
        online = fmnist.class_names[int(np.argmax(body["predictions"][0]))]
        assert online == rows[i]["prediction"], \
            f"online prediction for image {i} {body!r} differs from the job's {rows[i]!r}"
    print(f"job was {running_seen} when the online requests began")


def worker_threads(pid):
    """{thread name: [nice, ...]} of the modeld process, from /proc."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            comm = open(f"/proc/{pid}/task/{tid}/comm").read().strip()
            stat = open(f"/proc/{pid}/task/{tid}/stat").read()
        except OSError:
            continue  # the thread exited meanwhile
        fields = stat[stat.rindex(")") + 2:].split()  # from field 3 (state) on
        out.setdefault(comm, []).append(int(fields[16]))  # field 19: nice
    return out


@pytest.mark.parametrize("flag", [None, "7"])
def test_job_workers_run_at_job_nice(start_server, fmnist, tmp_path, flag):
    """Each loaded version has `workers` online workers (md-<model>, nice 0) and as
    many job workers (mj-<model>) at --job-nice (default 19), so the kernel runs
    online work first; the job still completes on them."""
    args = server_args(fmnist, tmp_path) + (("--job-nice", flag) if flag else ())
    srv = start_server(*args)
    deploy_fashion(srv)
    want = int(flag) if flag else 19
    workers = srv.get("/models/fashion").json()["loaded"][0]["workers"]
    # the workers name themselves and set their nice as they start
    deadline = time.monotonic() + 10 * TSCALE
    while True:
        threads = worker_threads(srv.proc.pid)
        if threads.get("md-fashion") == [0] * workers and \
                threads.get("mj-fashion") == [want] * workers:
            break
        assert time.monotonic() < deadline, \
            f"expected {workers} md-fashion workers at nice 0 and as many mj-fashion job " \
            f"workers at nice {want}: {threads}"
        time.sleep(0.05)
    stats = srv.get("/models/fashion").json()["loaded"][0]
    assert (stats["workers"], stats["job_workers"], stats["job_nice"]) == (workers, workers, want), stats
    assert stats["queued_job_chunks"] == 0, stats
    jid = create_job(srv, {"model": "fashion", "input": idx_input(), "batch_size": 64})
    job = wait_job(srv, jid)
    assert_done(job)
    assert_accuracy(job, fmnist)


def test_batch_size_is_the_forward_size(fashion, fmnist):
    """A job's batch_size is its forward size, even above the model's
    max_batch_size (64 here, which bounds online batching): 10,000 rows at
    batch_size 200 are exactly 50 forwards of 200 rows."""
    before = fashion.get("/models/fashion").json()["loaded"][0]
    assert before["max_batch_size"] == 64, before
    jid = create_job(fashion, {"model": "fashion", "input": idx_input(), "batch_size": 200,
                               "output": {"format": "npy"}})
    job = wait_job(fashion, jid)
    assert_done(job)
    assert_accuracy(job, fmnist)
    after = fashion.get("/models/fashion").json()["loaded"][0]
    more = after["batch_size_histogram"][7] - before["batch_size_histogram"][7]
    assert after["batches"] - before["batches"] == 50, (before, after)
    assert more == 50, f"expected 50 forwards of more than 64 rows: {before} -> {after}"
    assert after["rows"] - before["rows"] == N


def test_default_batch_size_is_the_versions_max_batch_size(start_server, fmnist, tmp_path):
    """Without batch_size a job uses the model version's batching.max_batch_size
    (from its config, over the server's --max-batch-size) and records it."""
    srv = start_server(*server_args(fmnist, tmp_path), "--max-batch-size", "16")
    config = json.loads(FASHION_JSON.read_text())
    config["batching"] = {"max_batch_size": 40}
    with open(FASHION_PT, "rb") as f:
        r = requests.post(srv.url + "/models/fashion/versions", files={"checkpoint": f},
                          data={"config": json.dumps(config)}, timeout=30 * TSCALE)
    assert r.status_code == 201, r.text
    jid = create_job(srv, {"model": "fashion", "input": idx_input()})
    job = wait_job(srv, jid)
    assert_done(job)
    assert job["spec"]["batch_size"] == 40, job["spec"]
    stats = srv.get("/models/fashion").json()["loaded"][0]
    # 10,000 = 250 x 40: every forward was a full chunk of 40 (bucket 33-64)
    assert stats["batch_size_histogram"][6] == 250, stats


# ------------------------------------------------------------ replicas sharing a store


def replicas(start_server, fmnist, tmp_path, *extra, a_extra=(), b_extra=()):
    """Two modeld processes on one store (the same tmp_path), B started before the
    model is deployed through A; a_extra and b_extra are for one of them only."""
    args = server_args(fmnist, tmp_path) + extra
    a = start_server(*args, *a_extra)
    b = start_server(*args, *b_extra)
    assert a.store == b.store
    deploy_fashion(a)
    return a, b


def test_replicas_share_the_jobs_once_each(start_server, fmnist, tmp_path):
    """Jobs created through either replica run once, each on one replica; both
    replicas take jobs (one runner each); every output is whole and in order.
    B never saw the deploy: it loads the store's default version to run a job."""
    # paced: a job of 10 chunks lasts 10 x PACE_MS, so neither replica can
    # finish its first job before the other has claimed one
    a, b = replicas(start_server, fmnist, tmp_path, "--max-jobs", "1", *PACED)
    spec = {"model": "fashion", "input": idx_input(), "batch_size": 1000}
    ids = [create_job(a, spec), create_job(b, spec), create_job(a, spec), create_job(b, spec)]
    jobs = [wait_job(a, jid) for jid in ids]
    for job in jobs:
        assert_done(job)
        assert_accuracy(job, fmnist)
        assert_full_jsonl(jsonl_rows(output(b, job["id"])), fmnist)
    owners = {job["owner"] for job in jobs}
    assert len(owners) == 2, f"expected both replicas to run jobs, owners: {owners}"
    pids = {int(o.split("|")[1]) for o in owners}
    assert pids == {a.proc.pid, b.proc.pid}, (owners, a.proc.pid, b.proc.pid)


def test_replica_takes_over_the_job_of_one_killed(start_server, fmnist, tmp_path):
    """kill -9 the replica running a job: the other one resumes it from the last
    committed chunk, and the output holds every row exactly once, in order."""
    a, b = replicas(start_server, fmnist, tmp_path, "--job-lease-s", "2", a_extra=PACED)
    jid = create_job(a, {"model": "fashion", "input": idx_input(), "batch_size": 16})
    job = wait_rows(a, jid, at_least=3 * 16)
    assert job["status"] == "running" and f"|{a.proc.pid}|" in job["owner"], job
    a.proc.kill()
    a.proc.wait(10)
    job = wait_job(b, jid)
    assert f"|{b.proc.pid}|" in job["owner"], job
    assert_done(job)
    assert_accuracy(job, fmnist)
    assert_full_jsonl(jsonl_rows(output(b, jid)), fmnist)


def test_cancel_through_another_replica(start_server, fmnist, tmp_path):
    """DELETE through B cancels the job A runs: A stops at its next commit and
    keeps a valid partial output."""
    a, b = replicas(start_server, fmnist, tmp_path, "--max-jobs", "1", a_extra=PACED)
    jid = create_job(a, {"model": "fashion", "input": idx_input(), "batch_size": 1})
    job = wait_rows(a, jid, at_least=3)
    assert f"|{a.proc.pid}|" in job["owner"], job
    r = b.request("DELETE", f"/jobs/{jid}")
    assert r.status_code == 202, f"DELETE through B: {r.status_code} {r.text!r}"
    job = wait_job(b, jid, want="cancelled", timeout=30)
    assert job["partial"] is True and 0 < job["rows_done"] < N, job
    rows = jsonl_rows(output(b, jid))
    assert [row["index"] for row in rows] == list(range(job["rows_done"])), "partial output has gaps"


def test_sigterm_hands_the_job_to_a_replica(start_server, fmnist, tmp_path):
    """SIGTERM gives a running job back at once: the replica goes on with it
    without waiting for a lease to end (the default lease is 30 s)."""
    a, b = replicas(start_server, fmnist, tmp_path, a_extra=PACED)
    jid = create_job(a, {"model": "fashion", "input": idx_input(), "batch_size": 16})
    wait_rows(a, jid, at_least=3 * 16)
    t0 = time.monotonic()
    assert a.stop(signal.SIGTERM) == 0, a.stderr[-2000:]
    job = wait_rows(b, jid, at_least=get_job(b, jid)["rows_done"] + 100, timeout=20)
    took = time.monotonic() - t0
    assert f"|{b.proc.pid}|" in job["owner"], job
    assert took < 15 * TSCALE, f"the replica took {took:.1f} s to go on with the job"
    job = wait_job(b, jid)
    assert_done(job)
    assert_full_jsonl(jsonl_rows(output(b, jid)), fmnist)


def loaded_default(srv, name="fashion"):
    """The version srv serves as `name`'s default, or None."""
    r = srv.get(f"/models/{name}")
    if r.status_code != 200:
        return None
    return next((v["version"] for v in r.json().get("loaded", []) if v["default"]), None)


def wait_until(what, fn, timeout=15):
    deadline = time.monotonic() + timeout * TSCALE
    while True:
        v = fn()
        if v:
            return v
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_replicas_converge_on_deploys_rollbacks_and_deletes(start_server, fmnist, tmp_path):
    """A deploy, a rollback and a delete made through A reach B (which polls
    the store's generation every --store-poll-ms) without a restart."""
    a = start_server("--store-poll-ms", "100")
    b = start_server("--store-poll-ms", "100")
    row = {"instances": [fmnist.images[0].tolist()]}
    assert b.request("POST", "/models/fashion/predict", json=row).status_code == 404

    deploy_fashion(a)
    wait_until("B to load version 1", lambda: loaded_default(b) == 1)
    r = b.request("POST", "/models/fashion/predict", json=row)
    assert r.status_code == 200, r.text
    first = r.json()["predictions"][0]

    deploy_fashion(a)  # version 2 becomes the default
    wait_until("B to serve version 2", lambda: loaded_default(b) == 2)
    r = a.request("PATCH", "/models/fashion", json={"default_version": 1})
    assert r.status_code == 200, r.text
    wait_until("B to roll back to version 1", lambda: loaded_default(b) == 1)
    r = b.request("POST", "/models/fashion/predict", json=row)
    assert r.status_code == 200 and r.json()["predictions"][0] == first, r.text

    r = a.request("DELETE", "/models/fashion")
    assert r.status_code in (200, 204), r.text
    wait_until("B to drop the model", lambda: b.request(
        "POST", "/models/fashion/predict", json=row).status_code == 404)
