"""
test_metrics.py - GET /metrics against the real binary: the scrape is valid
Prometheus text (`promtool check metrics`, Debian's prometheus package) taken
under load with a job running, and its numbers are what happened: requests
by route pattern (never a raw path) and status class, predictions, rows and
errors by kind per model version, histograms whose buckets add up, the store
and the jobs by state, the build info.
"""
import json
import os
import re
import shutil
import subprocess
import threading
import time

import numpy as np
import pytest

from conftest import REPO, TSCALE

FIXTURES = REPO / "tests" / "fixtures"
MLP_PT = FIXTURES / "mlp.pt"
THROWS_PT = FIXTURES / "throws.pt"
CONFIG = {"input": {"shape": [4]}}
ROWS = 3000       # job rows: 30 chunks of 100, each followed by the test pause
PACE_MS = 200     # the test-only pause after each committed chunk keeps the job running

SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})? (\S+)$')
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse(text):
    """{(name, frozenset(labels.items())): value} of every sample."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = SAMPLE.match(line)
        assert m, f"not a sample line: {line!r}"
        labels = frozenset(LABEL.findall(m.group(3) or ""))
        key = (m.group(1), labels)
        assert key not in out, f"duplicate series: {line!r}"
        out[key] = float(m.group(4))
    return out


def value(samples, name, **labels):
    want = frozenset(labels.items())
    found = [v for (n, ls), v in samples.items() if n == name and want <= ls]
    assert len(found) == 1, f"{name}{labels}: {len(found)} series match"
    return found[0]


def promtool(text):
    """`promtool check metrics` (PROMTOOL: the Makefile unpacks Debian's)."""
    tool = os.environ.get("PROMTOOL") or shutil.which("promtool")
    if not tool or not os.access(tool, os.X_OK):
        pytest.fail("promtool not found: run the tests with `make e2e` (it unpacks Debian's "
                    "prometheus package into build/tools) or set PROMTOOL")
    p = subprocess.run([tool, "check", "metrics"], input=text.encode(),
                       capture_output=True, timeout=60)
    assert p.returncode == 0, f"promtool: {p.stdout.decode()}{p.stderr.decode()}"


def check_histograms(samples):
    """Every histogram: buckets cumulative, +Inf bucket == _count."""
    buckets = {}
    for (name, labels), v in samples.items():
        if name.endswith("_bucket"):
            d = dict(labels)
            le = d.pop("le")
            buckets.setdefault((name[:-7], frozenset(d.items())), []).append(
                (float("inf") if le == "+Inf" else float(le), v))
    assert buckets, "no histogram in the scrape"
    for (base, labels), bs in buckets.items():
        bs.sort()
        counts = [v for _, v in bs]
        assert counts == sorted(counts), f"{base}{dict(labels)}: buckets not cumulative {bs}"
        assert bs[-1][0] == float("inf")
        assert samples[(base + "_count", labels)] == counts[-1], f"{base}{dict(labels)}"
        assert (base + "_sum", labels) in samples


def scrape(srv):
    r = srv.get("/metrics")
    assert r.status_code == 200, r.text
    assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4"), r.headers
    return r.text


def upload(srv, name, path):
    with open(path, "rb") as f:
        r = srv.request("POST", f"/models/{name}/versions", files={"checkpoint": f},
                        data={"config": json.dumps(CONFIG)})
    assert r.status_code == 201, r.text


def test_metrics_under_load_with_a_job(start_server, tmp_path):
    srv = start_server("--allowed-paths", str(tmp_path),
                       "--test-job-chunk-delay-ms", str(PACE_MS))
    upload(srv, "mlp", MLP_PT)
    upload(srv, "jobmodel", MLP_PT)
    upload(srv, "throws", THROWS_PT)
    rows = np.random.default_rng(3).random((ROWS, 4), dtype=np.float32)
    np.save(tmp_path / "rows.npy", rows)
    r = srv.request("POST", "/jobs", json={
        "model": "jobmodel", "batch_size": 100,
        "input": {"path": str(tmp_path / "rows.npy"), "format": "npy"},
        "output": {"path": str(tmp_path / "out.jsonl")}})
    assert r.status_code == 202, r.text
    jid = r.json()["id"]

    # a steady load beside the job and the scrapes
    sent = {"ok": 0}
    stop = threading.Event()

    def load():
        while not stop.is_set():
            r = srv.request("POST", "/models/mlp/predict", data="[[0.5, 1, 2, 3]]",
                            headers={"Content-Type": "application/json"})
            assert r.status_code == 200, r.text
            sent["ok"] += 1

    threads = [threading.Thread(target=load) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 60 * TSCALE
        while srv.get(f"/jobs/{jid}").json()["status"] != "running":
            assert time.monotonic() < deadline, "the job did not start"
            time.sleep(0.02)
        for _ in range(3):
            text = scrape(srv)
            promtool(text)
            s = parse(text)
            check_histograms(s)
            assert value(s, "modeld_jobs", state="running") == 1
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert sent["ok"] > 0
    assert value(s, "modeld_queue_depth", model="mlp", pool="online") >= 0
    srv.request("DELETE", f"/jobs/{jid}")


def test_metrics_count_what_happened(start_server, tmp_path):
    srv = start_server("--allowed-paths", str(tmp_path))
    upload(srv, "mlp", MLP_PT)
    upload(srv, "throws", THROWS_PT)
    json_h = {"Content-Type": "application/json"}
    for i in range(7):
        r = srv.request("POST", "/models/mlp/predict", data="[[1, 2, 3, 4], [0, 0, 0, 1]]",
                        headers=json_h)
        assert r.status_code == 200, r.text
    for _ in range(2):  # a bad body: 400 on the same route
        assert srv.request("POST", "/models/mlp/predict", data="[[1, 2]]",
                           headers=json_h).status_code == 400
    assert srv.request("POST", "/models/nope/predict", data="[[1, 2, 3, 4]]",
                       headers=json_h).status_code == 404
    assert srv.get("/no/such/route").status_code == 404
    # throws.pt raises on a negative first value: a failed forward, twice
    for _ in range(2):
        r = srv.request("POST", "/models/throws/predict", data="[[-1, 0, 0, 0]]",
                        headers=json_h)
        assert r.status_code == 422, r.text
    assert srv.request("POST", "/models/throws/predict", data="[[1, 0, 0, 0]]",
                       headers=json_h).status_code == 200
    # a labelled job over 250 rows, to the end
    rows = np.random.default_rng(4).random((250, 4), dtype=np.float32)
    np.save(tmp_path / "rows.npy", rows)
    r = srv.request("POST", "/jobs", json={
        "model": "mlp", "batch_size": 100,
        "input": {"path": str(tmp_path / "rows.npy"), "format": "npy"},
        "output": {"path": str(tmp_path / "out.jsonl")}})
    assert r.status_code == 202, r.text
    jid = r.json()["id"]
    deadline = time.monotonic() + 60 * TSCALE
    while srv.get(f"/jobs/{jid}").json()["status"] != "succeeded":
        assert time.monotonic() < deadline, "the job did not finish"
        time.sleep(0.02)

    text = scrape(srv)
    promtool(text)
    s = parse(text)
    check_histograms(s)
    # requests by route pattern and status class; no raw path anywhere
    pred = "/models/{name}/predict"
    assert value(s, "modeld_http_requests_total", route=pred, method="POST", code="2xx") == 8
    assert value(s, "modeld_http_requests_total", route=pred, method="POST", code="4xx") == 5
    assert value(s, "modeld_http_requests_total", route="none", code="4xx") == 1
    assert value(s, "modeld_http_request_duration_seconds_count", route=pred, method="POST",
                 code="2xx") == 8
    assert 'route="/models/mlp' not in text and "/no/such/route" not in text
    # per model version: 7 requests of 2 rows online, 3 chunks for the job
    assert value(s, "modeld_predictions_total", model="mlp", version="1") == 7 + 3
    assert value(s, "modeld_rows_total", model="mlp", version="1") == 14 + 250
    assert value(s, "modeld_batch_rows_count", model="mlp", version="1") == \
        value(s, "modeld_forward_seconds_count", model="mlp", version="1")
    assert value(s, "modeld_batch_rows_sum", model="mlp", version="1") == 14 + 250
    assert value(s, "modeld_queue_wait_seconds_count", model="mlp", version="1") == 7
    assert value(s, "modeld_prediction_errors_total", model="throws",
                 kind="forward_failed") == 2
    assert value(s, "modeld_prediction_errors_total", model="mlp", kind="forward_failed") == 0
    assert value(s, "modeld_prediction_errors_total", model="mlp", kind="rejected") == 0
    assert value(s, "modeld_model_loaded", model="mlp", version="1", default="1") == 1
    assert value(s, "modeld_model_load_seconds", model="mlp", version="1") > 0
    assert value(s, "modeld_queue_depth", model="mlp", pool="online") == 0
    # the store and the jobs
    assert value(s, "modeld_store_models") == 2
    assert value(s, "modeld_store_versions") == 2
    assert value(s, "modeld_store_version_bytes") == MLP_PT.stat().st_size + \
        THROWS_PT.stat().st_size
    assert value(s, "modeld_jobs", state="succeeded") == 1
    assert value(s, "modeld_job_rows_done", state="succeeded") == 250
    # the process
    assert value(s, "modeld_ready") == 1
    assert value(s, "modeld_resident_memory_bytes") > 1e6
    assert value(s, "modeld_uptime_seconds") > 0
    assert value(s, "modeld_http_connections") >= 1
    build = [dict(ls) for (n, ls) in s if n == "modeld_build_info"]
    assert len(build) == 1 and build[0]["version"] and build[0]["libtorch"] and \
        build[0]["cuda"] in ("0", "1"), build
