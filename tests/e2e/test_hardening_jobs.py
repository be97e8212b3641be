"""
test_hardening_jobs.py - batch jobs and downloads cannot reach where they
should not: internal addresses (SSRF), redirects out of allowed_urls, the
string-prefix tricks, symlinks out of allowed_paths (inputs, outputs, the
.partial file, GET /jobs/ID/output), a file that appears at the output path,
a second replica taking a job whose input is still downloading, a resumed NPY
job with no rows left, and dataset bytes in error messages and the log.

Every "internal service" is a python http.server on 127.0.0.1. Timing is made
deterministic with the test-only --test-job-chunk-delay-ms (the middle of a
job is a state that lasts) and with a download that trickles for many lease
periods; nothing depends on the machine's speed.
"""
import json
import os
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import TSCALE
from loopback import ALLOW_LOOPBACK, LoopbackServer
from test_jobs import (N, PACED, create_job, deploy_fashion, err_code, fmnist,  # noqa: F401
                       get_job, idx_input, job_count, jsonl_rows, output, post_job, server_args,
                       wait_job, wait_rows, write_small_csv)

SECRET = "SECRET_TOKEN=hunter2-3f9a"


class Service(LoopbackServer):
    """A fake internal service on 127.0.0.1: fixed bodies per path, redirects,
    an optional trickled body; counts GETs per path."""

    def __init__(self):
        self.routes = {}  # path -> (status, headers, body, trickle_s)
        super().__init__(self._respond)

    def _respond(self, h):
        status, headers, body, trickle_s = self.routes.get(h.path, (404, {}, b"not here\n", 0))
        h.send_response(status)
        for k, v in headers.items():
            h.send_header(k, v)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        try:
            if not trickle_s:
                h.wfile.write(body)
                return
            # the body in 20 pieces spread over trickle_s seconds
            step = max(1, len(body) // 20)
            for i in range(0, len(body), step):
                h.wfile.write(body[i:i + step])
                h.wfile.flush()
                time.sleep(trickle_s / 20)
        except (BrokenPipeError, ConnectionResetError):
            pass

    def serve(self, path, body, status=200, headers=None, trickle_s=0):
        self.routes[path] = (status, headers or {}, body, trickle_s)

    def redirect(self, path, location):
        self.routes[path] = (302, {"Location": location}, b"moved\n", 0)


@pytest.fixture
def service():
    s = Service()
    yield s
    s.close()


def small_csv_bytes(fmnist, rows=5):
    lines = [",".join(fmnist.columns + ["label"])]
    for i in range(rows):
        lines.append(",".join([str(v) for v in fmnist.images[i].tolist()] +
                              [str(int(fmnist.labels[i]))]))
    return ("\n".join(lines) + "\n").encode()


def url_job(url, fmt="csv"):
    return {"model": "fashion", "input": {"url": url, "format": fmt, "label": "label"}}


# ------------------------------------------------------------ SSRF


def test_job_url_to_loopback_is_refused_by_default(start_server, fmnist, tmp_path, service):
    """A job over http://127.0.0.1:PORT/creds gets nothing from the internal
    service: an address written out is refused at once (400, nothing stored);
    a name is refused on the address it resolves to, when the job connects."""
    service.serve("/creds", (SECRET + "\n").encode())
    srv = start_server(*server_args(fmnist, tmp_path))
    deploy_fashion(srv)
    before = job_count(srv)
    for url in (service.url("/creds"), f"http://[::ffff:127.0.0.1]:{service.port}/creds"):
        r = post_job(srv, url_job(url))
        assert r.status_code == 400 and err_code(r) == "source_not_allowed", f"{url}: {r.text}"
        assert "allow_private_urls" in r.json()["error"]["message"], r.text
    assert job_count(srv) == before, "a refused job was stored"
    jid = create_job(srv, url_job(f"http://localhost:{service.port}/creds"))
    job = wait_job(srv, jid, want="failed")
    assert "allow_private_urls" in job["error"], job
    assert SECRET not in json.dumps(job) and SECRET not in srv.stderr, job
    assert service.gets("/creds") == 0, "the internal service was reached"


def test_model_source_to_loopback_is_refused_by_default(server, service):
    service.serve("/cnn.pt", b"PK\x03\x04 not really a model")
    for url in (service.url("/cnn.pt"), f"http://localhost:{service.port}/cnn.pt"):
        r = server.request("POST", "/models", json={"name": "x", "source": url},
                           timeout=30 * TSCALE)
        assert r.status_code == 400 and err_code(r) == "source_not_allowed", f"{url}: {r.text}"
        assert "allow_private_urls" in r.json()["error"]["message"], r.text
    assert service.gets("/cnn.pt") == 0
    assert server.get("/models/x").status_code == 404


def test_url_dataset_errors_never_quote_its_bytes(start_server, fmnist, tmp_path, service):
    """Even where internal hosts are allowed, an error about downloaded data
    says where (row, header) and not what: the bytes may be a service's answer."""
    srv = start_server(*server_args(fmnist, tmp_path), *ALLOW_LOOPBACK)
    deploy_fashion(srv)
    # not a CSV with the asked-for label column: the first line is a secret
    service.serve("/creds", (SECRET + "\nfoo\n").encode())
    # a good header, then a row whose value is a secret
    body = small_csv_bytes(fmnist).decode().splitlines()
    cells = body[3].split(",")
    cells[100] = SECRET
    body[3] = ",".join(cells)
    service.serve("/row.csv", ("\n".join(body) + "\n").encode())
    for path, where in (("/creds", "header"), ("/row.csv", "row 2 (0-based, format csv): a value "
                                                     "is not a number")):
        jid = create_job(srv, url_job(service.url(path)))
        job = wait_job(srv, jid, want="failed")
        assert SECRET not in job["error"] and "hunter2" not in job["error"], job["error"]
        assert where in job["error"], f"{path}: the error should say {where!r}: {job['error']}"
        assert service.gets(path) == 1
    assert "hunter2" not in srv.stderr, "downloaded bytes reached the log"


# ------------------------------------------------------------ allowed_urls


def test_redirect_out_of_allowed_urls_is_refused(start_server, fmnist, tmp_path, service):
    """allowed_urls holds for every hop: /ok/ may redirect within /ok/, not to
    /private (same host) nor to another port; the targets are never fetched."""
    other = Service()
    try:
        data = small_csv_bytes(fmnist)
        service.serve("/ok/data.csv", data)
        service.serve("/private", (SECRET + "\n").encode())
        other.serve("/data.csv", data)
        service.redirect("/ok/inside", service.url("/ok/data.csv"))
        service.redirect("/ok/to-private", service.url("/private"))
        service.redirect("/ok/to-other-port", other.url("/data.csv"))
        srv = start_server(*server_args(fmnist, tmp_path), *ALLOW_LOOPBACK,
                           "--allowed-urls", service.url("/ok/"))
        deploy_fashion(srv)
        jid = create_job(srv, url_job(service.url("/ok/inside")))
        job = wait_job(srv, jid)
        assert job["rows_done"] == 5 and job["labeled"] == 5, job
        assert service.gets("/ok/data.csv") == 1
        for path in ("/ok/to-private", "/ok/to-other-port"):
            jid = create_job(srv, url_job(service.url(path)))
            job = wait_job(srv, jid, want="failed")
            assert "redirects to a URL outside allowed_urls" in job["error"], job
            assert "/private" not in job["error"] and str(other.port) not in job["error"], \
                f"the message quotes the redirect target: {job['error']}"
        assert service.gets("/private") == 0 and other.gets("/data.csv") == 0
        # a model source is held to the same rule
        r = srv.request("POST", "/models", json={"name": "m", "source":
                        service.url("/ok/to-private")}, timeout=30 * TSCALE)
        assert r.status_code == 400 and err_code(r) == "source_not_allowed", r.text
        assert service.gets("/private") == 0
    finally:
        other.close()


def test_allowed_urls_prefix_tricks_are_refused(start_server, fmnist, tmp_path, service):
    """An allowed_urls entry is a scheme, host, port and path, not a string
    prefix: a longer port, a user-info host and a sibling path do not match."""
    port = service.port
    allowed = [f"http://127.0.0.1:{port // 10}", f"http://127.0.0.1:{port}/ok"]
    srv = start_server(*server_args(fmnist, tmp_path), *ALLOW_LOOPBACK,
                       "--allowed-urls", ",".join(allowed))
    deploy_fashion(srv)
    before = job_count(srv)
    for url in (f"http://127.0.0.1:{port}/x.csv",               # port 4567 allows 45678?
                f"http://127.0.0.1:{port // 10}@127.0.0.1:{port}/x.csv",  # user info
                f"http://127.0.0.1:{port}/okay/x.csv",          # /ok is not /okay
                f"http://127.0.0.1:{port}/ok/../x.csv"):        # dot segments
        r = post_job(srv, url_job(url))
        assert r.status_code == 400 and err_code(r) == "source_not_allowed", \
            f"{url}: {r.status_code} {r.text}"
    assert job_count(srv) == before, "a refused job was stored"
    assert sum(service.counts.values()) == 0
    service.serve("/ok/x.csv", small_csv_bytes(fmnist))
    jid = create_job(srv, url_job(f"http://127.0.0.1:{port}/ok/x.csv"))
    assert wait_job(srv, jid)["rows_done"] == 5


# ------------------------------------------------------------ paths and symlinks


@pytest.fixture
def dirs(tmp_path):
    """allowed/ (the only allowed path) and outside/ with a secret file."""
    allowed = tmp_path / "allowed"
    outside = tmp_path / "outside"
    allowed.mkdir()
    outside.mkdir()
    secret = outside / "secret.txt"
    secret.write_text(SECRET + "\n")
    return allowed, outside, secret


def test_output_through_symlinks_is_refused(start_server, fmnist, dirs):
    allowed, outside, secret = dirs
    srv = start_server("--allowed-paths", str(allowed))
    deploy_fashion(srv)
    data = write_small_csv(allowed / "data.csv", fmnist)
    (allowed / "dirlink").symlink_to(outside)
    (allowed / "leaflink.jsonl").symlink_to(secret)
    before = job_count(srv)
    spec = {"model": "fashion", "input": {"path": data, "format": "csv", "label": "label"}}
    r = post_job(srv, {**spec, "output": {"path": str(allowed / "dirlink" / "out.jsonl")}})
    assert r.status_code == 400 and err_code(r) == "path_not_allowed", r.text
    assert "symlink" in r.json()["error"]["message"], r.text
    r = post_job(srv, {**spec, "output": {"path": str(allowed / "leaflink.jsonl")}})
    assert r.status_code == 409 and err_code(r) == "output_exists", r.text
    r = post_job(srv, {**spec, "output": {"path": data}})  # the input itself
    assert r.status_code == 409 and err_code(r) == "output_exists", r.text
    assert job_count(srv) == before
    assert secret.read_text() == SECRET + "\n" and sorted(os.listdir(outside)) == ["secret.txt"]


def test_planted_partial_symlink_is_not_followed(start_server, fmnist, dirs):
    """<out>.partial planted as a symlink to a file outside: the job writes a
    file of its own, never through the link."""
    allowed, outside, secret = dirs
    srv = start_server("--allowed-paths", str(allowed))
    deploy_fashion(srv)
    data = write_small_csv(allowed / "data.csv", fmnist)
    out = allowed / "out.jsonl"
    Path(str(out) + ".partial").symlink_to(secret)
    jid = create_job(srv, {"model": "fashion",
                           "input": {"path": data, "format": "csv", "label": "label"},
                           "output": {"path": str(out)}})
    job = wait_job(srv, jid)
    assert job["rows_done"] == 5, job
    assert secret.read_text() == SECRET + "\n", "the job wrote through the symlink"
    assert not out.is_symlink() and len(jsonl_rows(output(srv, jid))) == 5
    assert [p for p in os.listdir(allowed) if ".partial" in p] == [], os.listdir(allowed)


def test_output_that_appears_while_the_job_runs_is_kept(start_server, fmnist, dirs):
    allowed, _, _ = dirs
    srv = start_server("--allowed-paths", f"{allowed},{fmnist.dir}", *PACED)
    deploy_fashion(srv)
    out = allowed / "out.jsonl"
    jid = create_job(srv, {"model": "fashion", "batch_size": 1000,
                           "input": {"path": str(fmnist.csv), "format": "csv", "label": "label"},
                           "output": {"path": str(out)}})
    wait_rows(srv, jid, at_least=1000)  # 10 chunks, each followed by a pause
    out.write_text("someone else's file\n")
    job = wait_job(srv, jid, want="failed")
    assert "appeared while the job ran" in job["error"], job
    assert out.read_text() == "someone else's file\n"


def test_two_jobs_with_one_output_path(start_server, fmnist, dirs):
    """Two jobs given the same output.path (both accepted: nothing was there
    yet). The later one's file replaces the earlier one's .partial; the
    earlier job must then fail instead of publishing the other's unfinished
    rows as its own output, and the later one's output is whole."""
    allowed, _, _ = dirs
    srv = start_server("--allowed-paths", f"{allowed},{fmnist.dir}", *PACED)
    deploy_fashion(srv)
    out = allowed / "out.jsonl"
    spec = {"model": "fashion", "batch_size": 1000,
            "input": {"path": str(fmnist.csv), "format": "csv", "label": "label"},
            "output": {"path": str(out)}}
    first = create_job(srv, spec)
    wait_rows(srv, first, at_least=3000)  # 3 of its 10 paced chunks: far ahead
    second = create_job(srv, spec)
    job = wait_job(srv, first, want="failed")
    assert "another job wrote to the same output" in job["error"], job
    job = wait_job(srv, second)
    assert job["rows_done"] == N, job
    rows = jsonl_rows(output(srv, second))
    assert [row["index"] for row in rows] == list(range(N)), "the output is not the whole job's"


def test_input_swapped_for_a_symlink_before_the_job_runs(start_server, fmnist, dirs):
    """The input is opened when the job runs, not only checked when it is
    created: swapped for a symlink to a secret meanwhile, it is refused."""
    allowed, _, secret = dirs
    srv = start_server("--allowed-paths", f"{allowed},{fmnist.dir}", "--max-jobs", "1", *PACED)
    deploy_fashion(srv)
    first = create_job(srv, {"model": "fashion", "batch_size": 16,
                             "input": {"path": str(fmnist.csv), "format": "csv",
                                       "label": "label"}})
    wait_rows(srv, first, at_least=16)  # holds the only runner
    data = Path(write_small_csv(allowed / "data.csv", fmnist))
    jid = create_job(srv, {"model": "fashion",
                           "input": {"path": str(data), "format": "csv", "label": "label"}})
    assert get_job(srv, jid)["status"] == "queued"
    data.unlink()
    data.symlink_to(secret)
    assert srv.request("DELETE", f"/jobs/{first}").status_code == 202
    job = wait_job(srv, jid, want="failed")
    assert "symlink" in job["error"], job
    assert "hunter2" not in job["error"] and "hunter2" not in srv.stderr


def test_output_download_does_not_follow_a_symlink(start_server, fmnist, dirs):
    allowed, _, secret = dirs
    srv = start_server("--allowed-paths", str(allowed))
    deploy_fashion(srv)
    data = write_small_csv(allowed / "data.csv", fmnist)
    out = allowed / "out.jsonl"
    jid = create_job(srv, {"model": "fashion",
                           "input": {"path": data, "format": "csv", "label": "label"},
                           "output": {"path": str(out)}})
    wait_job(srv, jid)
    out.unlink()
    out.symlink_to(secret)
    r = srv.get(f"/jobs/{jid}/output")
    assert "hunter2" not in r.text, "GET /jobs/ID/output followed a symlink"
    assert r.status_code == 404 and err_code(r) == "output_missing", r.text


# ------------------------------------------------------------ leases, resume


def test_slow_download_keeps_its_lease(start_server, fmnist, tmp_path, service):
    """Two replicas, a 2 s lease, an input that trickles in over 12 s (six
    lease periods): the runner renews its lease while downloading, so the job
    is downloaded and run once, by one replica."""
    service.serve("/slow.csv", small_csv_bytes(fmnist, rows=20), trickle_s=12)
    args = server_args(fmnist, tmp_path) + ALLOW_LOOPBACK + ("--job-lease-s", "2")
    a = start_server(*args)
    b = start_server(*args)
    deploy_fashion(a)
    jid = create_job(a, url_job(service.url("/slow.csv")))
    job = wait_job(a, jid, timeout=60)
    assert job["rows_done"] == 20 and job["labeled"] == 20, job
    assert service.gets("/slow.csv") == 1, \
        f"the input was downloaded {service.gets('/slow.csv')} times: another replica took " \
        f"the job while it downloaded"
    rows = jsonl_rows(output(b, jid))
    assert [row["index"] for row in rows] == list(range(20)), rows


def test_npy_job_resumed_with_no_rows_left_keeps_its_shape(start_server, fmnist, tmp_path):
    """kill -9 after the last chunk is committed but before the job is marked
    done: the restart has nothing to compute and must keep the NPY shape."""
    args = server_args(fmnist, tmp_path)
    # one chunk of all rows, then a 60 s pause: "all committed, not finished"
    srv = start_server(*args, "--test-job-chunk-delay-ms", "60000")
    deploy_fashion(srv)
    jid = create_job(srv, {"model": "fashion", "input": idx_input(), "batch_size": N,
                           "output": {"format": "npy"}})
    job = wait_rows(srv, jid, at_least=N)
    assert job["status"] == "running" and job["rows_done"] == N, job
    srv.proc.kill()
    srv.proc.wait(10)
    srv2 = start_server(*args)
    job = wait_job(srv2, jid)
    assert job["rows_done"] == N, job
    r = output(srv2, jid)
    path = tmp_path / "out.npy"
    path.write_bytes(r.content)
    y = np.load(path)
    assert y.shape == (N, 10), f"the resumed NPY output has shape {y.shape}"
    right = int((np.argmax(y, axis=1) == fmnist.labels).sum())
    assert right == fmnist.correct, right


# ------------------------------------------------------------ the log


def test_dataset_bytes_are_escaped_in_the_log(start_server, fmnist, tmp_path):
    srv = start_server(*server_args(fmnist, tmp_path))
    deploy_fashion(srv)
    path = write_small_csv(tmp_path / "bad.csv", fmnist, bad=(2, 100, "1\x1b[2J\x07FAKE"))
    jid = create_job(srv, {"model": "fashion",
                           "input": {"path": path, "format": "csv", "label": "label"}})
    wait_job(srv, jid, want="failed")
    deadline = time.monotonic() + 10 * TSCALE
    while f"job {jid} failed" not in srv.stderr:
        assert time.monotonic() < deadline, srv.stderr[-2000:]
        time.sleep(0.05)
    line = next(ln for ln in srv.stderr.splitlines() if f"job {jid} failed" in ln)
    assert "\x1b" not in srv.stderr and "\x07" not in srv.stderr, repr(line)
    assert "\\x1b[2J\\x07FAKE" in line, repr(line)


def test_download_timeout_bounds_every_redirect_together(start_server, service):
    """download_timeout_s is the whole download's: each hop used to get the
    full timeout again, so N redirects could take N+1 times as long. Two
    redirects whose bodies trickle for 2 s each, under a 3 s timeout: the
    second hop runs out of the time the first left (each alone would fit)."""
    mlp = (Path(__file__).resolve().parents[1] / "fixtures" / "mlp.pt").read_bytes()
    service.serve("/model.pt", mlp)
    service.serve("/hop2", b"x" * 2000, status=302,
                  headers={"Location": service.url("/model.pt")}, trickle_s=2.0)
    service.serve("/hop1", b"x" * 2000, status=302,
                  headers={"Location": service.url("/hop2")}, trickle_s=2.0)
    srv = start_server(*ALLOW_LOOPBACK, "--download-timeout-s", "3")
    r = srv.request("POST", "/models", json={"name": "m", "source": service.url("/hop1")},
                    timeout=60 * TSCALE)
    assert r.status_code == 422, r.text
    assert "timed out" in r.json()["error"]["message"], r.text
    assert service.gets("/model.pt") == 0
