"""
test_job_retention.py - removing ended jobs on one host (SQLite index, blobs
in a directory), against the real binary:

- DELETE /jobs/ID?purge=true removes an ended job: its row (GET answers 404
  job_not_found, the list no longer shows it, /metrics counts it) and the
  output the server wrote in --store/jobs; an output.path the job was given
  stays, byte for byte;
- a queued or running job is not purged (409 job_not_finished, saying to
  cancel it first), and keeps running; once cancelled it is;
- a bad purge= value is a 400 naming the fix; an unknown job a 404;
- --job-retention-s removes what ended that long ago, with its output,
  never the output.path of another job, and keeps a job younger than that
  through many sweeps; a server started later with a retention removes
  what expired while it was down;
- an output.path inside the server's store is refused: a removal deletes
  what lies there.

The cluster side (the blob store's object, every replica's copy) is in
test_jobs_cluster.py. Nothing here sleeps to synchronise: a retention's
removal is polled for.
"""
import time

import pytest

from conftest import TSCALE
from test_jobs import (create_job, deploy_fashion, fmnist, get_job, post_job,  # noqa: F401
                       server_args, wait_job, wait_rows)


def purge(srv, jid, value="true"):
    return srv.request("DELETE", f"/jobs/{jid}?purge={value}", timeout=30 * TSCALE)


def job_files(store, jid):
    return sorted(p.name for p in (store / "jobs").glob(f"{jid}.*"))


def metric(srv, name):
    for line in srv.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    pytest.fail(f"no {name} in /metrics")


def poll(fn, what, timeout=60.0):
    deadline = time.monotonic() + timeout * TSCALE
    while time.monotonic() < deadline:
        if fn():
            return
        time.sleep(0.05)
    pytest.fail(f"{what}: not within {timeout * TSCALE:.0f} s")


def csv_job(fmnist, **output):
    return {"model": "fashion", "batch_size": 500,
            "input": {"path": str(fmnist.csv), "format": "csv", "label": "label"},
            "output": {"format": "csv", **output}}


def test_purge_removes_an_ended_job_and_the_servers_output_only(start_server, fmnist, tmp_path):
    srv = start_server(*server_args(fmnist, tmp_path))
    deploy_fashion(srv)
    own = create_job(srv, csv_job(fmnist))
    user_out = tmp_path / "mine.csv"
    theirs = create_job(srv, csv_job(fmnist, path=str(user_out)))
    wait_job(srv, own)
    wait_job(srv, theirs)
    assert job_files(srv.store, own) == [f"{own}.csv"]
    kept = user_out.read_bytes()
    assert kept.startswith(b"index,")

    r = purge(srv, own)
    assert r.status_code == 200, r.text
    assert r.json() == {"deleted": {"job": own}}
    r = srv.get(f"/jobs/{own}")
    assert r.status_code == 404 and r.json()["error"]["code"] == "job_not_found", r.text
    assert srv.get(f"/jobs/{own}/output").status_code == 404
    assert job_files(srv.store, own) == []
    listed = [j["id"] for j in srv.get("/jobs").json()["jobs"]]
    assert listed == [theirs], listed
    assert metric(srv, "modeld_jobs_removed_total") == 1
    assert f"job {own} removed" in srv.stderr

    # a job given an output.path: the row goes, the user's file stays
    assert purge(srv, theirs).status_code == 200
    assert user_out.read_bytes() == kept
    assert srv.get("/jobs").json()["jobs"] == []
    assert metric(srv, "modeld_jobs_removed_total") == 2
    assert 'modeld_jobs{state="succeeded"} 0' in srv.get("/metrics").text

    # gone is gone; a bad value says what it takes
    r = purge(srv, own)
    assert r.status_code == 404 and r.json()["error"]["code"] == "job_not_found", r.text
    r = purge(srv, theirs, "yes")
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "invalid_query"
    assert "purge=true" in r.json()["error"]["message"]


def test_a_running_job_is_not_purged_until_it_ended(start_server, fmnist, tmp_path):
    # 1 s after each of its 20 chunks: still running through the purge's 409
    srv = start_server(*server_args(fmnist, tmp_path), "--test-job-chunk-delay-ms", "1000")
    deploy_fashion(srv)
    jid = create_job(srv, csv_job(fmnist))
    wait_rows(srv, jid)  # paced: many chunks of 1 s each are still to come
    r = purge(srv, jid)
    assert r.status_code == 409, r.text
    err = r.json()["error"]
    assert err["code"] == "job_not_finished"
    assert f"DELETE /jobs/{jid}" in err["message"], err
    assert get_job(srv, jid)["status"] == "running"
    assert srv.request("DELETE", f"/jobs/{jid}").status_code == 202  # cancel
    wait_job(srv, jid, want="cancelled")
    assert job_files(srv.store, jid)  # the partial output
    assert purge(srv, jid).status_code == 200
    assert job_files(srv.store, jid) == []
    assert srv.get(f"/jobs/{jid}").status_code == 404


def test_retention_removes_what_ended_that_long_ago(start_server, fmnist, tmp_path):
    user_out = tmp_path / "mine.csv"
    srv = start_server(*server_args(fmnist, tmp_path))
    deploy_fashion(srv)
    kept_job = create_job(srv, csv_job(fmnist, path=str(user_out)))
    wait_job(srv, kept_job)
    kept = user_out.read_bytes()
    srv.stop()  # ended while no server had a retention
    # 5 s: long enough that wait_job below sees the new job succeed first
    srv = start_server(*server_args(fmnist, tmp_path), "--job-retention-s",
                       str(int(5 * TSCALE)), store=srv.store)
    # the job that ended before this start is removed by its first sweep
    poll(lambda: srv.get(f"/jobs/{kept_job}").status_code == 404,
         "the job ended before the start is removed")
    assert user_out.read_bytes() == kept
    jid = create_job(srv, csv_job(fmnist))
    job = wait_job(srv, jid)
    assert job["rows_done"] == 10000
    # the row goes first, then the files, then the count and the log line
    poll(lambda: srv.get(f"/jobs/{jid}").status_code == 404 and not job_files(srv.store, jid)
         and metric(srv, "modeld_jobs_removed_total") == 2, "the job is removed")
    poll(lambda: f"job {jid} removed (job_retention_s)" in srv.stderr, "the removal is logged")


def test_retention_keeps_a_job_younger_than_it(start_server, fmnist, tmp_path):
    # sweeps every 0.2 s (a test knob), so many of them see the young job
    srv = start_server(*server_args(fmnist, tmp_path), "--job-retention-s", "3600",
                       env={"MD_TEST_JOB_SWEEP_S": "0.2"})
    deploy_fashion(srv)
    jid = create_job(srv, csv_job(fmnist))
    wait_job(srv, jid)
    swept = metric(srv, "modeld_job_retention_sweeps_total")
    poll(lambda: metric(srv, "modeld_job_retention_sweeps_total") >= swept + 3,
         "three sweeps after the job ended")
    assert get_job(srv, jid)["status"] == "succeeded"
    assert job_files(srv.store, jid) == [f"{jid}.csv"]
    assert metric(srv, "modeld_jobs_removed_total") == 0


def test_an_output_path_in_the_store_is_refused(start_server, fmnist, tmp_path):
    store = tmp_path / "store"
    # allowed_paths covers the store here (tmp_path): the job is still refused
    srv = start_server(*server_args(fmnist, tmp_path), store=store)
    deploy_fashion(srv)
    for path in (store / "jobs" / "mine.csv", store / "mine.csv"):
        r = post_job(srv, csv_job(fmnist, path=str(path)))
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "invalid_job" and "server's own store" in err["message"], err
    assert srv.get("/jobs").json()["jobs"] == []
