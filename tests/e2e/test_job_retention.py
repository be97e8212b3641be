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
  never the output.path of another job; a server started later with a
  retention removes what expired while it was down.

The cluster side (the blob store's object, every replica's copy) is in
test_jobs_cluster.py. Nothing here sleeps to synchronise: a retention's
removal is polled for.
"""
import time

import pytest

from conftest import TSCALE
from test_jobs import (PACED, create_job, deploy_fashion, fmnist, get_job, server_args,  # noqa: F401
                       wait_job, wait_rows)


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
    srv = start_server(*server_args(fmnist, tmp_path), *PACED)
    deploy_fashion(srv)
    jid = create_job(srv, csv_job(fmnist))
    wait_rows(srv, jid)  # paced: many chunks of 200 ms each are still to come
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
    srv = start_server(*server_args(fmnist, tmp_path), "--job-retention-s", "2",
                       store=srv.store)
    # the job that ended before this start is removed by its first sweep
    poll(lambda: srv.get(f"/jobs/{kept_job}").status_code == 404,
         "the job ended before the start is removed")
    assert user_out.read_bytes() == kept
    jid = create_job(srv, csv_job(fmnist))
    job = wait_job(srv, jid)
    assert job["rows_done"] == 10000
    poll(lambda: srv.get(f"/jobs/{jid}").status_code == 404, "the job is removed")
    assert job_files(srv.store, jid) == []
    assert metric(srv, "modeld_jobs_removed_total") == 2
    assert "(job_retention_s)" in srv.stderr
