"""
test_jobs_cluster.py - one batch job spread over every replica (issue 26, part
2: chunks), against the real binary, a real PostgreSQL (pg.py) as the index
and a real S3 server (s3rver behind the SigV4 proxy: s3.py) holding the
dataset boto3 put there and the output:

- two and three replicas on one job over 60,000 rows: every replica computes
  chunks (its /metrics say so), GET /jobs/ID shows the chunks and their
  holders, and the output in S3 is byte for byte what one replica alone
  (SQLite, the single-host path) writes for the same input;
- kill -9 of a replica holding a chunk: another takes the chunk over once
  its lease (on the database's clock) ran out, and the output is exact;
- kill -STOP of a holder past its lease, then kill -CONT: its late work is
  refused (its own /metrics count it), and the output is exact;
- a CSV dataset with quoted newlines splits into chunks at whole rows only,
  and the job's accuracy is PyTorch's own count;
- cancel reaches every replica; the partial output is the longest contiguous
  prefix of done chunks;
- a local input at the same path on every replica (a shared volume) is split
  over them as an S3 one is; a replica that cannot read it gives its chunks
  back to the others;
- every part object, those of attempts that never finished too, is gone once
  the output is assembled;
- an image folder s3://BUCKET/PREFIX/ of PNGs in class folders splits by
  index over two replicas: the output is byte for byte one replica's, and the
  accuracy torchvision's ImageFolder with the model in this process;
- the input object replaced (boto3) in the middle of a chunked job: the job
  fails saying so, and no output is presented as its result.

Pacing: --test-job-chunk-delay-ms makes each batch of a chunk pause, so "a
replica holds a chunk" is a state that lasts, however fast the machine is;
nothing here sleeps to synchronise: every wait polls a condition.
"""
import io
import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from conftest import TSCALE
from loopback import LoopbackServer, send_file
from test_jobs import (N, create_job, deploy_fashion, fmnist, get_job, jsonl_rows, output,
                       read_idx_gz, IMAGES_GZ, wait_job)
from test_images_jobs import IMAGE_CONFIG, check_against_torch, folders  # noqa: F401 (fixture)

assert fmnist  # a fixture, used by name
ROWS = 60000
BATCH = 500
CHUNK_ROWS = 6000  # 10 chunks of 12 batches
LEASE_S = 2


def poll(fn, what, timeout=60.0):
    deadline = time.monotonic() + timeout * TSCALE
    last = None
    while time.monotonic() < deadline:
        last = fn()
        if last:
            return last
        time.sleep(0.02)
    pytest.fail(f"{what}: not within {timeout * TSCALE:.0f} s (last: {last!r})")


def metric(srv, name):
    text = srv.get("/metrics").text
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    pytest.fail(f"no {name} in /metrics of {srv.url}")


@pytest.fixture(scope="session")
def big_npy(tmp_path_factory):
    """60,000 rows: the FashionMNIST test images six times, uint8 [60000, 784]."""
    images = read_idx_gz(IMAGES_GZ).reshape(N, -1)
    data = np.concatenate([images] * (ROWS // N))
    path = tmp_path_factory.mktemp("big") / "big.npy"
    np.save(path, data)
    return path


def replica(start_server, s3, pg_url, store, *args, pace_ms=0, env=None):
    e = s3.env()
    # small pieces: a chunk takes several Range GETs; a stalled S3 fails a call in 3 s
    e.update({"MD_TEST_S3_PIECE_BYTES": str(1 << 20), "MD_TEST_S3_STALL_S": "3"})
    e.update(env or {})
    extra = ("--test-job-chunk-delay-ms", str(pace_ms)) if pace_ms else ()
    return start_server("--index-url", pg_url, "--blob-url", f"s3://{s3.bucket}/modeld",
                        "--allowed-s3", f"{s3.bucket}/data,{s3.bucket}/out",
                        "--job-lease-s", str(LEASE_S), "--max-jobs", "1", "--store-poll-ms", "50",
                        *extra, *args, env=e, store=store)


def reference(start_server, s3, tmp_path, spec):
    """The same job on one replica alone (SQLite: the single-host path)."""
    srv = start_server("--allowed-s3", f"{s3.bucket}/data,{s3.bucket}/out", env=s3.env(),
                       store=tmp_path / "single")
    deploy_fashion(srv)
    jid = create_job(srv, spec)
    wait_job(srv, jid, timeout=300)
    body = output(srv, jid).content
    srv.stop()
    return body


def wait_through_outage(srv, jid, timeout=300):
    """wait_job, where GET /jobs/ID may answer 503 while the index is back
    on its feet (the replica reconnects on its next call)."""
    def done():
        r = srv.get(f"/jobs/{jid}")
        return r.status_code == 200 and r.json()["status"] in ("succeeded", "failed",
                                                                "cancelled") and r.json()
    job = poll(done, f"job {jid} ends", timeout)
    assert job["status"] == "succeeded", f"{job}\n{srv.stderr[-3000:]}"
    return job


def s3_get(s3, key):
    return s3.client().get_object(Bucket=s3.bucket, Key=key)["Body"].read()


def s3_keys(s3, prefix):
    out = s3.client().list_objects_v2(Bucket=s3.bucket, Prefix=prefix)
    return sorted(o["Key"] for o in out.get("Contents", []))


def holder_pid(owner):
    return int(owner.split("|")[1])


def npy_spec(s3, out_key):
    return {"model": "fashion", "batch_size": BATCH, "chunk_rows": CHUNK_ROWS,
            "input": {"path": f"s3://{s3.bucket}/data/big.npy", "format": "npy"},
            "output": {"path": f"s3://{s3.bucket}/out/{out_key}", "format": "npy"}}


@pytest.mark.parametrize("n_replicas", [2, 3])
def test_replicas_share_one_job_and_write_what_one_replica_writes(start_server, s3, pg_url,
                                                                  tmp_path, big_npy, n_replicas):
    s3.client().upload_file(str(big_npy), s3.bucket, "data/big.npy")
    want = reference(start_server, s3, tmp_path, npy_spec(s3, "single.npy"))
    reps = [replica(start_server, s3, pg_url, tmp_path / f"r{i}", pace_ms=50)
            for i in range(n_replicas)]
    deploy_fashion(reps[0])
    jid = create_job(reps[0], npy_spec(s3, "cluster.npy"))
    # every replica holds a chunk at some point: polled, not slept for
    pids = {r.proc.pid for r in reps}
    seen = set()

    def all_held():
        job = get_job(reps[-1], jid)
        seen.update(holder_pid(h) for h in (job.get("chunks") or {}).get("holders", []))
        return seen >= pids or job["status"] != "running" and job["status"] != "queued"
    poll(all_held, "every replica holds a chunk")
    assert seen >= pids, f"chunk holders {seen}, replicas {pids}"
    job = wait_job(reps[1], jid, timeout=300)
    assert job["rows_done"] == ROWS and job["rows_total"] == ROWS, job
    assert job["chunks"]["total"] == ROWS // CHUNK_ROWS, job
    assert job["chunks"]["done"] == ROWS // CHUNK_ROWS and job["chunks"]["running"] == 0, job
    got = s3_get(s3, "out/cluster.npy")
    assert got == want, "the cluster's output differs from one replica's"
    assert output(reps[0], jid).content == want  # the coordinator's store copy
    out = np.load(io.BytesIO(got))
    assert out.shape == (ROWS, 10), out.shape
    finished = [metric(r, "modeld_job_chunks_finished_total") for r in reps]
    assert all(f >= 1 for f in finished), f"chunks finished per replica {finished}"
    assert sum(finished) == ROWS // CHUNK_ROWS, finished
    rows = [metric(r, "modeld_job_chunk_rows_total") for r in reps]
    assert sum(rows) == ROWS and all(x > 0 for x in rows), rows
    # the chunk objects are gone once assembled, and the coordinator's copies of its own
    poll(lambda: s3_keys(s3, "out/cluster.npy.chunks/") == [], "the parts are deleted")
    poll(lambda: not [p for i in range(n_replicas) for p in (tmp_path / f"r{i}" / "jobs").glob("*")
                      if ".part" in p.name], "no part kept on a replica's disk")


def held_by(srv, jid, pid):
    job = get_job(srv, jid)
    return any(holder_pid(h) == pid for h in (job.get("chunks") or {}).get("holders", []))


def two_replicas_one_job(start_server, s3, pg_url, tmp_path, big_npy, out_key):
    s3.client().upload_file(str(big_npy), s3.bucket, "data/big.npy")
    a = replica(start_server, s3, pg_url, tmp_path / "a", pace_ms=100)
    deploy_fashion(a)
    jid = create_job(a, npy_spec(s3, out_key))
    poll(lambda: get_job(a, jid).get("owner"), "a coordinator holds the job")
    b = replica(start_server, s3, pg_url, tmp_path / "b", pace_ms=100)
    # the coordinator is A (the job was made there and A runs it): B only runs chunks
    assert holder_pid(get_job(a, jid)["owner"]) == a.proc.pid
    poll(lambda: held_by(a, jid, b.proc.pid), "B holds a chunk")
    return a, b, jid


def test_kill9_of_a_chunk_holder_is_taken_over_and_the_output_is_exact(start_server, s3, pg_url,
                                                                      tmp_path, big_npy):
    a, b, jid = two_replicas_one_job(start_server, s3, pg_url, tmp_path, big_npy, "k9.npy")
    os.kill(b.proc.pid, signal.SIGKILL)
    b.proc.wait()
    poll(lambda: metric(a, "modeld_job_chunks_taken_over_total") >= 1,
         "A takes B's chunk over once its lease ran out")
    job = wait_job(a, jid, timeout=300)
    assert job["rows_done"] == ROWS, job
    want = reference(start_server, s3, tmp_path, npy_spec(s3, "k9-single.npy"))
    assert s3_get(s3, "out/k9.npy") == want


def test_a_paused_holder_past_its_lease_finishes_nothing(start_server, s3, pg_url, tmp_path,
                                                         big_npy):
    a, b, jid = two_replicas_one_job(start_server, s3, pg_url, tmp_path, big_npy, "stop.npy")
    os.kill(b.proc.pid, signal.SIGSTOP)
    try:
        poll(lambda: metric(a, "modeld_job_chunks_taken_over_total") >= 1,
             "A takes the paused B's chunk over")
    finally:
        os.kill(b.proc.pid, signal.SIGCONT)
    poll(lambda: metric(b, "modeld_job_chunks_refused_total") >= 1,
         "B, resumed, learns its chunk is another's and finishes nothing")
    job = wait_job(a, jid, timeout=300)
    assert job["rows_done"] == ROWS and job["chunks"]["done"] == ROWS // CHUNK_ROWS, job
    want = reference(start_server, s3, tmp_path, npy_spec(s3, "stop-single.npy"))
    assert s3_get(s3, "out/stop.npy") == want
    # only the finishing attempt of each chunk left an object, and those are gone
    poll(lambda: s3_keys(s3, "out/stop.npy.chunks/") == [], "the parts are deleted")


def test_csv_with_quoted_newlines_splits_at_whole_rows(start_server, s3, pg_url, tmp_path, fmnist):
    # the FashionMNIST CSV with a quoted text column holding newlines
    lines = fmnist.csv.read_text().splitlines()
    head, rows = lines[0], lines[1:]
    text = head + ",note\n" + "".join(
        f'{r},"row {i}\nline two, with a comma"\n' if i % 3 == 0 else f"{r},plain\n"
        for i, r in enumerate(rows))
    s3.client().put_object(Bucket=s3.bucket, Key="data/notes.csv", Body=text.encode())
    features = [c for c in head.split(",") if c != "label"]
    spec = {"model": "fashion", "batch_size": 100, "chunk_rows": 700,
            "input": {"path": f"s3://{s3.bucket}/data/notes.csv", "format": "csv",
                      "label": "label", "features": features},
            "output": {"path": f"s3://{s3.bucket}/out/notes.csv", "format": "csv"}}
    a = replica(start_server, s3, pg_url, tmp_path / "a")
    b = replica(start_server, s3, pg_url, tmp_path / "b")
    deploy_fashion(a)
    jid = create_job(a, spec)
    job = wait_job(b, jid, timeout=300)
    assert job["chunks"]["total"] == (N + 699) // 700, job
    assert job["rows_done"] == N and job["labeled"] == N, job
    assert job["correct"] == fmnist.correct, job
    got = s3_get(s3, "out/notes.csv")
    spec["output"]["path"] = f"s3://{s3.bucket}/out/notes-single.csv"
    assert got == reference(start_server, s3, tmp_path, spec)
    assert got.decode().splitlines()[0] == "index,prediction,label"


def test_cancel_reaches_every_replica_and_keeps_the_done_prefix(start_server, s3, pg_url, tmp_path,
                                                                big_npy):
    a, b, jid = two_replicas_one_job(start_server, s3, pg_url, tmp_path, big_npy, "cancel.npy")
    poll(lambda: get_job(a, jid)["chunks"]["done"] >= 1, "a chunk is done")
    r = b.request("DELETE", f"/jobs/{jid}")  # through the replica that does not coordinate
    assert r.status_code == 202, r.text
    job = wait_job(a, jid, "cancelled", timeout=120)
    assert job["partial"] is True, job
    # neither replica holds a chunk of it any more, and none is claimed again
    poll(lambda: get_job(a, jid)["chunks"]["running"] == 0, "every runner gave its chunk back")
    done = get_job(a, jid)["chunks"]["done"]
    assert 1 <= done < ROWS // CHUNK_ROWS, job
    got = np.load(io.BytesIO(s3_get(s3, "out/cancel.npy")))
    # the longest run of done chunks from the first: whole chunks, in order
    assert got.shape[0] % CHUNK_ROWS == 0 and 1 <= got.shape[0] // CHUNK_ROWS <= done, got.shape
    want = np.load(io.BytesIO(reference(start_server, s3, tmp_path,
                                        npy_spec(s3, "cancel-single.npy"))))
    assert (got == want[:got.shape[0]]).all()
    assert output(a, jid).content == s3_get(s3, "out/cancel.npy")


def test_postgresql_restarted_mid_job_finishes_exactly_once(start_server, s3, pg_cluster, pg_url,
                                                            tmp_path, big_npy):
    a, b, jid = two_replicas_one_job(start_server, s3, pg_url, tmp_path, big_npy, "pg.npy")
    poll(lambda: get_job(a, jid)["chunks"]["done"] >= 1, "a chunk is done")
    pg_cluster.stop("fast")
    try:
        # both replicas notice: a renewal or a claim fails while it is away
        poll(lambda: "retrying" in a.stderr or "given back" in a.stderr or
             "given back" in b.stderr, "a replica noticed PostgreSQL away")
    finally:
        pg_cluster.start()
    job = wait_through_outage(a, jid)
    assert job["rows_done"] == ROWS and job["chunks"]["done"] == ROWS // CHUNK_ROWS, job
    want = reference(start_server, s3, tmp_path, npy_spec(s3, "pg-single.npy"))
    assert s3_get(s3, "out/pg.npy") == want
    # a part whose finish met the outage names no chunk: swept at assembly all the same
    poll(lambda: s3_keys(s3, "out/pg.npy.chunks/") == [], "the parts are deleted")


def test_s3_stalled_mid_chunk_finishes_exactly_once(start_server, s3, pg_url, tmp_path, big_npy):
    a, b, jid = two_replicas_one_job(start_server, s3, pg_url, tmp_path, big_npy, "stall.npy")
    poll(lambda: get_job(a, jid)["chunks"]["done"] >= 1, "a chunk is done")
    os.kill(s3.pid, signal.SIGSTOP)
    try:
        poll(lambda: "S3" in a.stderr[-20000:] and ("given back" in a.stderr or
                                                   "given back" in b.stderr),
             "a chunk's S3 call fails and the chunk is given back", 120)
    finally:
        os.kill(s3.pid, signal.SIGCONT)
    job = wait_job(a, jid, timeout=300)
    assert job["rows_done"] == ROWS and job["chunks"]["done"] == ROWS // CHUNK_ROWS, job
    want = reference(start_server, s3, tmp_path, npy_spec(s3, "stall-single.npy"))
    assert s3_get(s3, "out/stall.npy") == want
    poll(lambda: s3_keys(s3, "out/stall.npy.chunks/") == [], "the parts are deleted")


def test_a_local_input_every_replica_sees_is_split_over_them(start_server, s3, pg_url, tmp_path,
                                                             big_npy):
    # one host here: the same path on both replicas stands in for a shared volume
    s3.client().upload_file(str(big_npy), s3.bucket, "data/big.npy")
    want = reference(start_server, s3, tmp_path, npy_spec(s3, "local-single.npy"))
    spec = npy_spec(s3, "local.npy")
    spec["input"]["path"] = str(big_npy)
    reps = [replica(start_server, s3, pg_url, tmp_path / f"r{i}", "--allowed-paths",
                    str(big_npy.parent), pace_ms=50) for i in range(2)]
    deploy_fashion(reps[0])
    jid = create_job(reps[0], spec)
    pids, seen = {r.proc.pid for r in reps}, set()

    def all_held():
        job = get_job(reps[1], jid)
        seen.update(holder_pid(h) for h in (job.get("chunks") or {}).get("holders", []))
        return seen >= pids or job["status"] not in ("running", "queued")
    poll(all_held, "both replicas hold a chunk of the local file")
    assert seen >= pids, f"chunk holders {seen}, replicas {pids}"
    job = wait_job(reps[1], jid, timeout=300)
    assert job["chunks"]["total"] == ROWS // CHUNK_ROWS and job["rows_done"] == ROWS, job
    assert s3_get(s3, "out/local.npy") == want
    poll(lambda: s3_keys(s3, "out/local.npy.chunks/") == [], "the parts are deleted")


def test_a_replica_that_cannot_see_a_local_input_leaves_its_chunks_to_the_others(
        start_server, s3, pg_url, tmp_path, big_npy):
    s3.client().upload_file(str(big_npy), s3.bucket, "data/big.npy")
    want = reference(start_server, s3, tmp_path, npy_spec(s3, "blind-single.npy"))
    spec = npy_spec(s3, "blind.npy")
    spec["input"]["path"] = str(big_npy)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    a = replica(start_server, s3, pg_url, tmp_path / "a", "--allowed-paths", str(big_npy.parent),
                pace_ms=50)
    # B's allowed_paths do not hold the file: a misconfigured replica
    b = replica(start_server, s3, pg_url, tmp_path / "b", "--allowed-paths", str(elsewhere),
                pace_ms=50)
    deploy_fashion(a)
    jid = create_job(a, spec)
    poll(lambda: "input_not_on_replica" in b.stderr or "cannot be read on this replica" in
         b.stderr, "B tries a chunk, cannot read the file and gives the chunk back")
    job = wait_job(a, jid, timeout=300)
    assert job["rows_done"] == ROWS and job["chunks"]["done"] == ROWS // CHUNK_ROWS, job
    assert metric(b, "modeld_job_chunks_finished_total") == 0
    assert s3_get(s3, "out/blind.npy") == want


@pytest.mark.parametrize("gz", [False, True])
def test_idx_with_labels_in_s3_splits_by_its_header(start_server, s3, pg_url, tmp_path, fmnist,
                                                    gz):
    import gzip
    from test_jobs import LABELS_GZ
    images = IMAGES_GZ.read_bytes() if gz else gzip.decompress(IMAGES_GZ.read_bytes())
    labels = gzip.decompress(LABELS_GZ.read_bytes())
    c = s3.client()
    c.put_object(Bucket=s3.bucket, Key="data/images.idx", Body=images)
    c.put_object(Bucket=s3.bucket, Key="data/labels.idx", Body=labels)
    name = "gz" if gz else "plain"
    spec = {"model": "fashion", "batch_size": 100, "chunk_rows": 1500,
            "input": {"path": f"s3://{s3.bucket}/data/images.idx", "format": "idx",
                      "label": f"s3://{s3.bucket}/data/labels.idx"},
            "output": {"path": f"s3://{s3.bucket}/out/{name}.jsonl", "format": "jsonl"}}
    a = replica(start_server, s3, pg_url, tmp_path / "a")
    b = replica(start_server, s3, pg_url, tmp_path / "b")
    deploy_fashion(a)
    jid = create_job(a, spec)
    job = wait_job(b, jid, timeout=300)
    # plain IDX: rows of a fixed size from the header; gzip: no random access, one chunk
    assert job["chunks"]["total"] == (1 if gz else (N + 1499) // 1500), job
    assert job["rows_done"] == N and job["labeled"] == N, job
    assert job["correct"] == fmnist.correct, job
    got = s3_get(s3, f"out/{name}.jsonl")
    spec["output"]["path"] = f"s3://{s3.bucket}/out/{name}-single.jsonl"
    assert got == reference(start_server, s3, tmp_path, spec)


def local_job_with_a_chunk_done(start_server, s3, pg_url, tmp_path, big_npy, out_key):
    """A paced job over a local copy of big_npy on one replica, once its first chunk is
    done: (the replica, the job's id, the input's path)."""
    data = tmp_path / "data"
    data.mkdir()
    path = data / "big.npy"
    path.write_bytes(big_npy.read_bytes())
    spec = npy_spec(s3, out_key)
    spec["input"]["path"] = str(path)
    a = replica(start_server, s3, pg_url, tmp_path / "a", "--allowed-paths", str(data),
                pace_ms=100)
    deploy_fashion(a)
    jid = create_job(a, spec)
    poll(lambda: (get_job(a, jid).get("chunks") or {}).get("done", 0) >= 1, "a chunk is done")
    return a, jid, path


def test_a_local_input_cut_short_after_planning_fails_the_job(start_server, s3, pg_url, tmp_path,
                                                              big_npy):
    a, jid, path = local_job_with_a_chunk_done(start_server, s3, pg_url, tmp_path, big_npy,
                                               "cut.npy")
    with open(path, "r+b") as f:  # the second half of the rows is gone
        f.truncate(path.stat().st_size // 2)
    job = wait_job(a, jid, "failed", timeout=300)
    assert "changed since the job was planned" in job["error"], job
    assert "out/cut.npy" not in s3_keys(s3, "out/cut.npy"), "a failed job wrote an output"
    # and its chunks' parts are swept
    poll(lambda: s3_keys(s3, "out/cut.npy.chunks/") == [], "the failed job's parts deleted")


def deploy_images(srv):
    from test_jobs import FASHION_PT
    with open(FASHION_PT, "rb") as f:
        r = srv.request("POST", "/models/fashion/versions", files={"checkpoint": f},
                        data={"config": json.dumps(IMAGE_CONFIG)})
    assert r.status_code == 201, r.text


def test_an_s3_image_folder_splits_by_index_over_two_replicas(start_server, s3, pg_url, tmp_path,
                                                             folders):
    root, expected = folders
    local = root / "fashion"
    c = s3.client()
    for f in sorted(local.rglob("*.png")):
        c.upload_file(str(f), s3.bucket, "data/cimgs/" + str(f.relative_to(local)))
    # not rows: a file that is no image (files_skipped), a hidden file and a
    # hidden folder (never read, as on disk)
    c.put_object(Bucket=s3.bucket, Key="data/cimgs/README.txt", Body=b"not an image")
    first = sorted(local.rglob("*.png"))[0]
    c.upload_file(str(first), s3.bucket, "data/cimgs/.hidden.png")
    c.upload_file(str(first), s3.bucket, "data/cimgs/0/.thumbs/x.png")
    inc = ["index", "path", "prediction", "label"]

    def spec(out_key):
        return {"model": "fashion", "batch_size": 16, "chunk_rows": 32,
                "input": {"format": "images", "path": f"s3://{s3.bucket}/data/cimgs/"},
                "output": {"path": f"s3://{s3.bucket}/out/{out_key}", "include": inc}}
    single = start_server("--allowed-s3", f"{s3.bucket}/data,{s3.bucket}/out", env=s3.env(),
                          store=tmp_path / "single")
    deploy_images(single)
    jid = create_job(single, spec("imgs-single.jsonl"))
    want_job = wait_job(single, jid, timeout=300)
    want = output(single, jid).content
    single.stop()

    # 200 images, 7 chunks of 2 batches; each batch pauses 300 ms, so one
    # replica alone would take seconds: the other claims chunks meanwhile
    reps = [replica(start_server, s3, pg_url, tmp_path / f"r{i}", pace_ms=300) for i in range(2)]
    deploy_images(reps[0])
    jid = create_job(reps[0], spec("imgs-cluster.jsonl"))
    job = wait_job(reps[1], jid, timeout=300)
    n = len(expected["fashion"])
    assert job["chunks"]["total"] == (n + 31) // 32, job
    finished = [metric(r, "modeld_job_chunks_finished_total") for r in reps]
    assert all(f >= 1 for f in finished), f"chunks finished per replica {finished}"
    assert sum(finished) == job["chunks"]["total"], finished
    got = s3_get(s3, "out/imgs-cluster.jsonl")
    assert got == want, "the cluster's output differs from one replica's"
    for k in ("rows_total", "rows_done", "correct", "labeled", "confusion", "accuracy",
              "files_skipped"):
        assert job[k] == want_job[k], (k, job, want_job)
    assert job["files_skipped"] == 1, job
    check_against_torch(job, jsonl_rows(output(reps[0], jid)), expected["fashion"])
    # each chunk's copy of its images goes with the chunk
    for r in reps:
        assert not list((r.store / "jobs").glob("*.images")), list((r.store / "jobs").iterdir())


def test_an_input_replaced_mid_job_fails_it_and_is_never_mixed(start_server, s3, pg_url, tmp_path,
                                                              big_npy):
    c = s3.client()
    c.upload_file(str(big_npy), s3.bucket, "data/replaced.npy")
    spec = npy_spec(s3, "replaced.npy")
    spec["input"]["path"] = f"s3://{s3.bucket}/data/replaced.npy"
    a = replica(start_server, s3, pg_url, tmp_path / "a", pace_ms=100)
    b = replica(start_server, s3, pg_url, tmp_path / "b", pace_ms=100)
    deploy_fashion(a)
    jid = create_job(a, spec)
    poll(lambda: (get_job(a, jid).get("chunks") or {}).get("done", 0) >= 1, "a chunk is done")
    # the same shape, other pixels: only the ETag tells the versions apart
    data = np.load(big_npy)
    buf = io.BytesIO()
    np.save(buf, 255 - data)
    c.put_object(Bucket=s3.bucket, Key="data/replaced.npy", Body=buf.getvalue())
    job = wait_job(b, jid, "failed", timeout=300)
    assert "data/replaced.npy changed since the job was planned" in job["error"], job
    assert "run the job again" in job["error"], job
    assert job["chunks"]["done"] < ROWS // CHUNK_ROWS, job
    # nothing is presented as the job's output
    assert "out/replaced.npy" not in s3_keys(s3, "out/replaced.npy"), s3_keys(s3, "out/")
    assert a.get(f"/jobs/{jid}/output").status_code != 200


def test_an_image_replaced_mid_job_fails_it(start_server, s3, pg_url, tmp_path, folders):
    root, _ = folders
    local = root / "fashion"
    files = sorted(local.rglob("*.png"))
    c = s3.client()
    for f in files:
        c.upload_file(str(f), s3.bucket, "data/rimgs/" + str(f.relative_to(local)))
    a = replica(start_server, s3, pg_url, tmp_path / "a", pace_ms=300)
    deploy_images(a)
    jid = create_job(a, {"model": "fashion", "batch_size": 16, "chunk_rows": 32,
                         "input": {"format": "images", "path": f"s3://{s3.bucket}/data/rimgs/"},
                         "output": {"path": f"s3://{s3.bucket}/out/rimgs.jsonl"}})
    poll(lambda: (get_job(a, jid).get("chunks") or {}).get("done", 0) >= 1, "a chunk is done")
    # the last image (the last chunk's, which no runner took yet) becomes another picture
    last = str(files[-1].relative_to(local))
    c.upload_file(str(files[0]), s3.bucket, "data/rimgs/" + last)
    job = wait_job(a, jid, "failed", timeout=300)
    assert f"data/rimgs/{last} changed since the job was planned" in job["error"], job
    assert "run the job again" in job["error"], job
    assert "out/rimgs.jsonl" not in s3_keys(s3, "out/rimgs.jsonl")


def test_a_local_input_deleted_after_planning_fails_the_job(start_server, s3, pg_url, tmp_path,
                                                            big_npy):
    a, jid, path = local_job_with_a_chunk_done(start_server, s3, pg_url, tmp_path, big_npy,
                                               "gone.npy")
    path.unlink()
    # the replica that planned the job cannot read it any more: nobody will, so it fails
    job = wait_job(a, jid, "failed", timeout=300)
    assert "cannot be read on this replica" in job["error"], job
    poll(lambda: s3_keys(s3, "out/gone.npy.chunks/") == [], "the failed job's parts deleted")


def test_two_jobs_naming_one_output_never_share_a_part(start_server, s3, pg_url, tmp_path,
                                                       big_npy):
    c = s3.client()
    c.upload_file(str(big_npy), s3.bucket, "data/big.npy")
    rev = tmp_path / "rev.npy"
    np.save(rev, np.load(big_npy)[::-1])
    c.upload_file(str(rev), s3.bucket, "data/rev.npy")
    forward, backward = npy_spec(s3, "f-single.npy"), npy_spec(s3, "b-single.npy")
    backward["input"]["path"] = f"s3://{s3.bucket}/data/rev.npy"
    want = {reference(start_server, s3, tmp_path / "f", forward),
            reference(start_server, s3, tmp_path / "b", backward)}
    a = replica(start_server, s3, pg_url, tmp_path / "a", pace_ms=20)
    b = replica(start_server, s3, pg_url, tmp_path / "b2", pace_ms=20)
    deploy_fashion(a)
    one, two = npy_spec(s3, "same.npy"), npy_spec(s3, "same.npy")
    two["input"]["path"] = f"s3://{s3.bucket}/data/rev.npy"
    jobs = [create_job(a, one), create_job(b, two)]
    ends = [poll(lambda j=j: get_job(a, j)["status"] in ("succeeded", "failed") and
                 get_job(a, j), f"job {j} ends", 300) for j in jobs]
    assert sorted(e["status"] for e in ends) == ["failed", "succeeded"], ends
    failed = next(e for e in ends if e["status"] == "failed")
    assert "already exists" in failed["error"], failed
    # the output is one job's rows, whole: never parts of both
    assert s3_get(s3, "out/same.npy") in want
    poll(lambda: s3_keys(s3, "out/same.npy.chunks/") == [], "every part deleted")


# ---- a job with no output.path: its output is the blob store's object ----
# s3://BUCKET/modeld/jobs/<id>/output.<ext> (blob_url s3://BUCKET/modeld),
# though allowed_s3 names only BUCKET/data and BUCKET/out: the bucket is the
# server's own.

def jobs_key(jid, ext):
    return f"modeld/jobs/{jid}/output.{ext}"


def coordinator_and_other(reps, jid):
    owner = poll(lambda: get_job(reps[0], jid).get("owner"), "a coordinator holds the job")
    pid = holder_pid(owner)
    coord = [r for r in reps if r.proc.pid == pid]
    assert coord, f"job {jid} held by {owner}, not one of the replicas"
    return coord[0], [r for r in reps if r.proc.pid != pid][0]


def test_no_output_path_chunks_into_the_blob_store_and_any_replica_serves_it(
        start_server, s3, pg_url, tmp_path, fmnist):
    s3.client().upload_file(str(fmnist.csv), s3.bucket, "data/nopath.csv")
    spec = {"model": "fashion", "batch_size": 100, "chunk_rows": 1000,
            "input": {"path": f"s3://{s3.bucket}/data/nopath.csv", "format": "csv",
                      "label": "label"},
            "output": {"format": "csv"}}
    want = reference(start_server, s3, tmp_path, spec)  # one host: a local file
    reps = [replica(start_server, s3, pg_url, tmp_path / f"r{i}", pace_ms=100) for i in range(2)]
    deploy_fashion(reps[0])
    jid = create_job(reps[0], spec)
    coord, other = coordinator_and_other(reps, jid)
    # the other replica computes chunks of it too (polled, not slept for)
    poll(lambda: held_by(coord, jid, other.proc.pid) or
         get_job(coord, jid)["status"] not in ("queued", "running"), "the other replica holds a chunk")
    job = wait_job(other, jid, timeout=300)
    assert job["chunks"]["total"] == N // 1000 and job["chunks"]["done"] == N // 1000, job
    assert job["rows_done"] == N and job["correct"] == fmnist.correct, job
    assert metric(other, "modeld_job_chunks_finished_total") >= 1
    # the assembled output is the object under the store's jobs/ key ...
    assert s3_get(s3, jobs_key(jid, "csv")) == want
    poll(lambda: s3_keys(s3, jobs_key(jid, "csv") + ".chunks/") == [], "the parts are deleted")
    # ... which the replica that did not assemble streams from S3
    assert not (tmp_path / "r0" / "jobs" / f"{jid}.csv").exists() or \
        not (tmp_path / "r1" / "jobs" / f"{jid}.csv").exists()
    r = output(other, jid, "text/csv")
    assert r.content == want and r.headers["Content-Length"] == str(len(want))
    assert "X-Partial" not in r.headers
    assert output(coord, jid, "text/csv").content == want  # its own copy
    # the blob store's sweep looks under modeld/blobs/ only: the checkpoint is there
    assert s3_keys(s3, "modeld/blobs/")


def test_no_output_path_single_runner_uploads_and_any_replica_serves_it(
        start_server, s3, pg_url, tmp_path, fmnist):
    # an input.url (no byte ranges to split by): one runner
    single = start_server("--allowed-paths", str(fmnist.dir), store=tmp_path / "single")
    deploy_fashion(single)
    sid = create_job(single, {"model": "fashion", "batch_size": 500,
                              "input": {"path": str(fmnist.npy), "format": "npy"}})
    wait_job(single, sid, timeout=300)
    want = output(single, sid, "application/x-ndjson").content
    single.stop()
    files = LoopbackServer(lambda h: send_file(h, fmnist.dir, h.path))
    spec = {"model": "fashion", "batch_size": 500,
            "input": {"url": files.url("/" + fmnist.npy.name), "format": "npy"}}
    # 64 KiB pieces: the streamed reply waits for S3 several times (suspended, resumed)
    reps = [replica(start_server, s3, pg_url, tmp_path / f"r{i}", "--allow-private-urls", "1",
                    pace_ms=200, env={"MD_TEST_S3_PIECE_BYTES": str(64 << 10)})
            for i in range(2)]
    deploy_fashion(reps[0])
    jid = create_job(reps[1], spec)
    # mid-job (paced: 20 commits of 200 ms), what an earlier run of this job
    # could have left at its key: the job's own upload replaces it
    poll(lambda: get_job(reps[0], jid)["rows_done"] > 0, "the job has committed rows")
    s3.client().put_object(Bucket=s3.bucket, Key=jobs_key(jid, "jsonl"), Body=b"left over\n")
    assert get_job(reps[0], jid)["status"] == "running"
    job = wait_job(reps[0], jid, timeout=300)
    assert job["rows_done"] == N, job
    files.close()
    assert not (job.get("chunks") or {}).get("total"), f"an input.url is not chunked: {job}"
    # uploaded before the job read as succeeded
    assert s3_get(s3, jobs_key(jid, "jsonl")) == want
    ran = [r for i, r in enumerate(reps) if (tmp_path / f"r{i}" / "jobs" / f"{jid}.jsonl").exists()]
    assert len(ran) == 1, "exactly one replica ran the job and holds its local copy"
    other = reps[1] if ran[0] is reps[0] else reps[0]
    assert output(ran[0], jid, "application/x-ndjson").content == want  # the local copy
    r = output(other, jid, "application/x-ndjson")  # streamed from S3
    assert r.content == want and r.headers["Content-Length"] == str(len(want))
    # several at once, each its own stream: every one whole
    with ThreadPoolExecutor(6) as pool:
        bodies = list(pool.map(lambda _: output(other, jid).content, range(6)))
    assert all(b == want for b in bodies)
    # the object gone: the replica without a copy names the problem
    s3.client().delete_object(Bucket=s3.bucket, Key=jobs_key(jid, "jsonl"))
    assert s3_keys(s3, f"modeld/jobs/{jid}/") == [], "the object is deleted"
    r = other.get(f"/jobs/{jid}/output")
    assert r.status_code == 404, r.text[:300]
    err = r.json()["error"]
    assert err["code"] == "output_missing" and jobs_key(jid, "jsonl") in err["message"], err


def test_no_output_path_cancelled_keeps_the_done_prefix_and_says_partial_on_any_replica(
        start_server, s3, pg_url, tmp_path, fmnist):
    s3.client().upload_file(str(fmnist.npy), s3.bucket, "data/cancel-nopath.npy")
    spec = {"model": "fashion", "batch_size": 100, "chunk_rows": 1000,
            "input": {"path": f"s3://{s3.bucket}/data/cancel-nopath.npy", "format": "npy"},
            "output": {"format": "npy"}}
    a = replica(start_server, s3, pg_url, tmp_path / "a", pace_ms=100)
    deploy_fashion(a)
    jid = create_job(a, spec)
    poll(lambda: get_job(a, jid).get("owner"), "a coordinator holds the job")
    b = replica(start_server, s3, pg_url, tmp_path / "b", pace_ms=100)
    assert holder_pid(get_job(a, jid)["owner"]) == a.proc.pid  # B only runs chunks
    poll(lambda: get_job(a, jid)["chunks"]["done"] >= 1, "a chunk is done")
    r = b.request("DELETE", f"/jobs/{jid}")
    assert r.status_code == 202, r.text
    job = wait_job(a, jid, "cancelled", timeout=120)
    assert job["partial"] is True, job
    got = s3_get(s3, jobs_key(jid, "npy"))
    out = np.load(io.BytesIO(got))
    # whole chunks from the first (none, if the done one was not chunk 0)
    assert out.shape[0] % 1000 == 0 and out.shape[0] < N, out.shape
    # B never assembled it: it streams the object, and says it is partial
    assert not (tmp_path / "b" / "jobs" / f"{jid}.npy").exists()
    r = output(b, jid, "application/x-npy")
    assert r.content == got and r.headers.get("X-Partial") == "true", r.headers
    # purged: nothing of it stays in S3, not even a part a runner still on
    # a chunk at the cancel puts late (the purge fences its chunks: that
    # runner's finish is refused and it deletes its part)
    assert b.request("DELETE", f"/jobs/{jid}?purge=true").status_code == 200
    poll(lambda: s3_keys(s3, f"modeld/jobs/{jid}/") == [], "no object of the purged job left")


def test_a_job_of_one_chunk_with_no_output_path_is_copied_to_the_blob_store(
        start_server, s3, pg_url, tmp_path, fmnist):
    s3.client().upload_file(str(fmnist.csv), s3.bucket, "data/own.csv")
    spec = {"model": "fashion", "batch_size": 500, "chunk_rows": 2 * N,
            "input": {"path": f"s3://{s3.bucket}/data/own.csv", "format": "csv",
                      "label": "label"}, "output": {"format": "csv"}}
    a = replica(start_server, s3, pg_url, tmp_path / "a")
    b = replica(start_server, s3, pg_url, tmp_path / "b")
    deploy_fashion(a)
    jid = create_job(a, spec)
    job = wait_job(b, jid, timeout=300)
    assert job["chunks"]["total"] == 1, job
    got = s3_get(s3, jobs_key(jid, "csv"))
    single = json.loads(json.dumps(spec))
    single["output"]["path"] = f"s3://{s3.bucket}/out/own-single.csv"
    assert got == reference(start_server, s3, tmp_path, single)
    assert output(b, jid, "text/csv").content == got  # streamed from S3 by the other replica
    poll(lambda: s3_keys(s3, jobs_key(jid, "csv") + ".chunks/") == [], "the parts are deleted")


@pytest.mark.parametrize("ofmt", ["npy", "csv", "jsonl"])
def test_a_job_of_one_chunk_is_a_copy_of_its_part_and_what_one_replica_writes(
        start_server, s3, pg_url, tmp_path, fmnist, ofmt):
    s3.client().upload_file(str(fmnist.csv), s3.bucket, "data/one.csv")
    spec = {"model": "fashion", "batch_size": 500, "chunk_rows": 2 * N,
            "input": {"path": f"s3://{s3.bucket}/data/one.csv", "format": "csv",
                      "label": "label"},
            "output": {"path": f"s3://{s3.bucket}/out/one.{ofmt}", "format": ofmt}}
    a = replica(start_server, s3, pg_url, tmp_path / "a")
    b = replica(start_server, s3, pg_url, tmp_path / "b")
    deploy_fashion(a)
    jid = create_job(a, spec)
    job = wait_job(b, jid, timeout=300)
    assert job["chunks"]["total"] == 1 and job["rows_done"] == N, job
    assert job["labeled"] == N and job["correct"] == fmnist.correct, job
    got = s3_get(s3, f"out/one.{ofmt}")
    single = json.loads(json.dumps(spec))
    single["output"]["path"] = f"s3://{s3.bucket}/out/one-single.{ofmt}"
    assert got == reference(start_server, s3, tmp_path, single)
    assert output(a, jid).content == got  # the store's copy, the part kept on its disk
    poll(lambda: s3_keys(s3, f"out/one.{ofmt}.chunks/") == [], "the parts are deleted")
    # a second job naming the same output is refused, not written over
    again = create_job(a, spec)
    failed = wait_job(a, again, "failed", timeout=120)
    assert "already exists" in failed["error"], failed
    assert s3_get(s3, f"out/one.{ofmt}") == got


def csv_job_in_s3(s3, fmnist, key, **output):
    """A chunked job (5 chunks) over the FashionMNIST CSV put at data/KEY."""
    s3.client().upload_file(str(fmnist.csv), s3.bucket, f"data/{key}")
    return {"model": "fashion", "batch_size": 500, "chunk_rows": 2000,
            "input": {"path": f"s3://{s3.bucket}/data/{key}", "format": "csv",
                      "label": "label"}, "output": {"format": "csv", **output}}


def test_a_single_runners_final_put_holds_the_jobs_lease(start_server, s3, pg_url, pg_cluster,
                                                         tmp_path, fmnist):
    # an input.url: one runner. Its upload and the record of its success are
    # held apart (a test knob: while a file exists), as a put of gigabytes
    files = LoopbackServer(lambda h: send_file(h, fmnist.dir, h.path))
    spec = {"model": "fashion", "batch_size": 500,
            "input": {"url": files.url("/" + fmnist.npy.name), "format": "npy"},
            "output": {"format": "jsonl", "path": f"s3://{s3.bucket}/out/held.jsonl"}}
    hold = tmp_path / "hold"
    hold.touch()
    a = replica(start_server, s3, pg_url, tmp_path / "a", "--allow-private-urls", "1",
                env={"MD_TEST_OUTPUT_HOLD": str(hold)})
    deploy_fashion(a)
    jid = create_job(a, spec)
    poll(lambda: f"job {jid}: output put; test hold" in a.stderr, "A put the output")
    # B could run it (same model, same rights) and looks for jobs to take over
    b = replica(start_server, s3, pg_url, tmp_path / "b", "--allow-private-urls", "1")
    db = pg_url.rsplit("/", 1)[1]

    def lease():
        until, now, owner = pg_cluster.psql(  # owner is host|pid|nonce: last
            f"SELECT lease_until, extract(epoch from clock_timestamp()), owner FROM jobs "
            f"WHERE id = '{jid}'", db=db).split("|", 2)
        return owner, float(until), float(now)
    t0 = lease()[2]  # the index's clock, B running
    # on that clock, two leases on: still A's, its lease renewed meanwhile
    poll(lambda: lease()[1] > t0 + 2 * LEASE_S, "the job's lease renewed past two leases")
    assert holder_pid(lease()[0]) == a.proc.pid, "B took over a job whose runner was alive"
    hold.unlink()
    job = wait_job(b, jid, timeout=300)
    files.close()
    assert job["rows_done"] == N, job
    poll(lambda: f"job {jid} succeeded" in a.stderr, "A records and logs its success")
    assert f"job {jid}" not in b.stderr, "B ran the job too"
    assert "another process holds it now" not in a.stderr
    assert s3_get(s3, "out/held.jsonl").count(b"\n") == N


def test_purge_on_any_replica_removes_the_blob_store_output_and_every_copy(
        start_server, s3, pg_url, tmp_path, fmnist):
    own_spec = csv_job_in_s3(s3, fmnist, "purge.csv")
    user_spec = json.loads(json.dumps(own_spec))
    user_spec["output"]["path"] = f"s3://{s3.bucket}/out/purge-kept.csv"
    # the janitor's own sweep an hour away (a test knob): only the NOTIFY
    # of the removal can make the assembler remove its copy in this test
    reps = [replica(start_server, s3, pg_url, tmp_path / f"r{i}",
                    env={"MD_TEST_JOB_SWEEP_S": "3600"}) for i in range(2)]
    deploy_fashion(reps[0])
    jid = create_job(reps[0], own_spec)
    job = wait_job(reps[1], jid, timeout=300)
    assert job["chunks"]["total"] == N // 2000, job
    want = s3_get(s3, jobs_key(jid, "csv"))
    # the assembler (the coordinator, or one that took the job over) keeps a copy
    copies = [i for i in range(2) if (tmp_path / f"r{i}" / "jobs" / f"{jid}.csv").exists()]
    assert len(copies) == 1, copies
    coord, other = reps[copies[0]], reps[1 - copies[0]]
    store = tmp_path / f"r{copies[0]}"
    assert (store / "jobs" / f"{jid}.csv").read_bytes() == want
    # a part an unfinished attempt could have left beside the output
    s3.client().put_object(Bucket=s3.bucket, Key=jobs_key(jid, "csv") + f".chunks/{jid}/0-9",
                           Body=b"left over")
    # purged through the replica that did not assemble it
    r = other.request("DELETE", f"/jobs/{jid}?purge=true")
    assert r.status_code == 200, r.text
    assert s3_keys(s3, f"modeld/jobs/{jid}/") == []
    for srv in reps:
        r = srv.get(f"/jobs/{jid}")
        assert r.status_code == 404 and r.json()["error"]["code"] == "job_not_found", r.text
    # the assembler hears of it (NOTIFY) and removes its own copy
    poll(lambda: not list((store / "jobs").glob(f"{jid}.*")), "the assembler's copy is removed")
    poll(lambda: f"removed elsewhere taken from this store ({jid})" in coord.stderr,
         "the assembler logs it")
    assert metric(other, "modeld_jobs_removed_total") == 1
    assert s3_keys(s3, "modeld/blobs/"), "the checkpoints are untouched"

    # a user's output.path in S3 is never removed
    kid = create_job(reps[1], user_spec)
    wait_job(reps[0], kid, timeout=300)
    assert s3_get(s3, "out/purge-kept.csv") == want
    assert reps[0].request("DELETE", f"/jobs/{kid}?purge=true").status_code == 200
    assert s3_get(s3, "out/purge-kept.csv") == want
    assert reps[1].get(f"/jobs/{kid}").status_code == 404
    # and none may be put where the server keeps its own
    r = reps[0].request("POST", "/jobs", json={**user_spec, "output": {
        "path": f"s3://{s3.bucket}/modeld/jobs/mine.csv", "format": "csv"}})
    assert r.status_code == 400 and "server's own store" in r.json()["error"]["message"], r.text


def test_retention_on_every_replica_removes_each_job_once(start_server, s3, pg_url, tmp_path,
                                                           fmnist):
    spec = csv_job_in_s3(s3, fmnist, "keep.csv")
    # 10 s: every job is seen succeeded before any is removed
    reps = [replica(start_server, s3, pg_url, tmp_path / f"r{i}", "--job-retention-s",
                    str(int(10 * TSCALE)), env={"MD_TEST_JOB_SWEEP_S": "0.2"}) for i in range(3)]
    deploy_fashion(reps[0])
    jids = [create_job(reps[i], spec) for i in range(3)]
    for jid in jids:
        job = wait_job(reps[0], jid, timeout=300)
        assert job["chunks"]["total"] == N // 2000, job
    for jid in jids:
        poll(lambda: reps[1].get(f"/jobs/{jid}").status_code == 404, f"job {jid} is removed")
    # every replica swept; each job was removed by exactly one of them (a
    # removal counts once its rows are gone: polled, then it must stay so)
    poll(lambda: sum(metric(r, "modeld_jobs_removed_total") for r in reps) >= len(jids),
         "three removals counted")
    assert sum(metric(r, "modeld_jobs_removed_total") for r in reps) == len(jids)
    assert all(metric(r, "modeld_job_retention_sweeps_total") >= 1 for r in reps)
    assert s3_keys(s3, "modeld/jobs/") == []
    for i in range(3):
        poll(lambda: not list((tmp_path / f"r{i}" / "jobs").glob("j*")),
             f"replica {i} holds no file of the removed jobs")


def test_a_cancelled_jobs_output_stays_the_same_when_its_coordinator_stops(
        start_server, s3, pg_url, tmp_path, fmnist):
    # 5 chunks: A (the coordinator, one runner) does chunk 0, then holds
    # chunk 1 computed, past its last renewal (a test knob: while the file
    # holds/1 exists, its lease kept); B does chunks 2 to 4
    spec = csv_job_in_s3(s3, fmnist, "cancel.csv", path=f"s3://{s3.bucket}/out/cancelled.csv")
    holds = tmp_path / "holds"
    holds.mkdir()
    (holds / "1").touch()
    a = replica(start_server, s3, pg_url, tmp_path / "a",
                env={"MD_TEST_CHUNK_FINISH_HOLD": str(holds),
                     "MD_TEST_PAUSE_AFTER_OUTPUT_MS": "600000"})
    deploy_fashion(a)
    jid = create_job(a, spec)
    poll(lambda: f"job {jid} chunk 1: test hold" in a.stderr, "A holds chunk 1")
    b = replica(start_server, s3, pg_url, tmp_path / "b")
    poll(lambda: get_job(b, jid)["chunks"]["done"] == 4, "B does chunks 2 to 4")
    assert b.request("DELETE", f"/jobs/{jid}").status_code == 202
    # chunk 1, done after the cancel, is refused; the output is chunk 0 alone
    (holds / "1").unlink()
    poll(lambda: f"job {jid}: output put; test pause" in a.stderr, "A put the partial output")
    assert metric(a, "modeld_job_chunks_refused_total") == 1
    first = s3_get(s3, "out/cancelled.csv")
    assert first.count(b"\n") == 2000 + 1, "the header and chunk 0's rows"
    # A stops before recording it: B takes the job over, assembles the same
    # chunks, finds its output there byte for byte, and records the cancel
    os.kill(a.proc.pid, signal.SIGKILL)
    job = wait_job(b, jid, want="cancelled", timeout=300)
    assert job.get("partial") is True, job
    assert s3_get(s3, "out/cancelled.csv") == first
    # the counts are the output's rows, not those of every chunk done
    assert job["rows_done"] == 2000 and job["labeled"] == 2000, job
    assert sum(map(sum, job["confusion"])) == 2000, job
    # an ended job runs no chunk: chunk 1's refused holder is not shown
    assert job["chunks"]["running"] == 0 and job["chunks"]["holders"] == [], job
    poll(lambda: s3_keys(s3, "out/cancelled.csv.chunks/") == [], "the parts are deleted")


def test_a_removal_is_stamped_on_the_index_clock_not_a_skewed_hosts(start_server, s3, pg_url,
                                                                    tmp_path, fmnist):
    # C alone assembles two jobs: it holds a copy of each output
    spec = csv_job_in_s3(s3, fmnist, "skew.csv")
    c = replica(start_server, s3, pg_url, tmp_path / "c")
    deploy_fashion(c)
    jids = [create_job(c, spec) for _ in range(2)]
    for jid in jids:
        wait_job(c, jid, timeout=300)
        assert (tmp_path / "c" / "jobs" / f"{jid}.csv").exists()
    # A's host clock is an hour ahead, B's is right
    a = replica(start_server, s3, pg_url, tmp_path / "a", env={"MD_TEST_CLOCK_SKEW_S": "3600"})
    b = replica(start_server, s3, pg_url, tmp_path / "b")
    assert a.request("DELETE", f"/jobs/{jids[0]}?purge=true").status_code == 200
    poll(lambda: not (tmp_path / "c" / "jobs" / f"{jids[0]}.csv").exists(),
         "C removes its copy of the job A removed")
    # had A stamped the removal an hour ahead, C would read removals from
    # there on, and miss B's
    assert b.request("DELETE", f"/jobs/{jids[1]}?purge=true").status_code == 200
    poll(lambda: not (tmp_path / "c" / "jobs" / f"{jids[1]}.csv").exists(),
         "C removes its copy of the job B removed after")
    poll(lambda: f"removed elsewhere taken from this store ({jids[1]})" in c.stderr, "C logs it")


def test_purge_without_the_right_to_list_deletes_the_output_and_parts_by_key(
        start_server, s3, pg_url, tmp_path, fmnist):
    spec = csv_job_in_s3(s3, fmnist, "nolist.csv")
    reps = [replica(start_server, s3, pg_url, tmp_path / f"r{i}") for i in range(2)]
    deploy_fashion(reps[0])
    jid = create_job(reps[0], spec)
    wait_job(reps[1], jid, timeout=300)
    # the parts go once the job's success is recorded: polled
    poll(lambda: s3_keys(s3, f"modeld/jobs/{jid}/") == [jobs_key(jid, "csv")],
         "the output alone is left in S3")
    # a part its chunk 0 names (as one whose delete failed after assembly)
    chunks = reps[0].get(f"/jobs/{jid}").json()["chunks"]
    assert chunks["done"] == N // 2000
    left = jobs_key(jid, "csv") + f".chunks/{jid}/000000-1"
    s3.client().put_object(Bucket=s3.bucket, Key=left, Body=b"part")
    s3.deny_listing(f"modeld/jobs/{jid}/")
    try:
        r = reps[1].request("DELETE", f"/jobs/{jid}?purge=true")
        assert r.status_code == 200, r.text
    finally:
        s3.deny_listing(None)
    assert "S3 refused to list" in reps[1].stderr
    assert s3_keys(s3, f"modeld/jobs/{jid}/") == [], "the output and the named part deleted"


def test_job_outputs_streaming_at_once_are_bounded(start_server, s3, pg_url, tmp_path, fmnist):
    spec = csv_job_in_s3(s3, fmnist, "streams.csv")
    # one stream at most (a test knob; 64 by default); S3 calls wait a minute
    env = {"MD_TEST_OUTPUT_STREAMS_MAX": "1", "MD_TEST_S3_STALL_S": "60"}
    reps = [replica(start_server, s3, pg_url, tmp_path / f"r{i}", env=env) for i in range(2)]
    deploy_fashion(reps[0])
    jid = create_job(reps[0], spec)
    wait_job(reps[1], jid, timeout=300)
    want = s3_get(s3, jobs_key(jid, "csv"))
    copies = [i for i in range(2) if (tmp_path / f"r{i}" / "jobs" / f"{jid}.csv").exists()]
    other = reps[1 - copies[0]]  # no copy: it streams the output from S3
    os.kill(s3.pid, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(lambda: other.get(f"/jobs/{jid}/output", timeout=120 * TSCALE))
            poll(lambda: metric(other, "modeld_job_output_streams") == 1, "one stream open")
            r = other.get(f"/jobs/{jid}/output")
            assert r.status_code == 503, r.text[:300]
            assert r.json()["error"]["code"] == "overloaded" and r.headers.get("Retry-After")
            assert "streaming from S3" in r.json()["error"]["message"]
            os.kill(s3.pid, signal.SIGCONT)
            r = first.result()
    finally:
        os.kill(s3.pid, signal.SIGCONT)
    assert r.status_code == 200 and r.content == want
    poll(lambda: metric(other, "modeld_job_output_streams") == 0, "the stream's slot given back")
    assert output(other, jid).content == want
    # a stream that never starts (the object is gone) gives its slot back too
    s3.client().delete_object(Bucket=s3.bucket, Key=jobs_key(jid, "csv"))
    for _ in range(3):
        assert other.get(f"/jobs/{jid}/output").status_code == 404
    assert metric(other, "modeld_job_output_streams") == 0


@pytest.mark.parametrize("chunk_rows", [2000, 2 * N], ids=["5 chunks", "one chunk"])
@pytest.mark.parametrize("replaced", [False, True], ids=["as put", "replaced"])
def test_a_coordinator_stopped_after_its_upload_leaves_the_job_to_finish_elsewhere(
        start_server, s3, pg_url, tmp_path, fmnist, chunk_rows, replaced):
    spec = csv_job_in_s3(s3, fmnist, "takeover.csv", path=f"s3://{s3.bucket}/out/takeover.csv")
    spec["chunk_rows"] = chunk_rows
    # A holds the window between its upload and the record of it open (a
    # test knob) until it is killed there
    a = replica(start_server, s3, pg_url, tmp_path / "a",
                env={"MD_TEST_PAUSE_AFTER_OUTPUT_MS": "600000"})
    deploy_fashion(a)
    jid = create_job(a, spec)
    poll(lambda: f"job {jid}: output put; test pause" in a.stderr, "A put the output and waits")
    want = s3_get(s3, "out/takeover.csv")
    if replaced:  # someone else's bytes of the same size: never taken for the job's
        other = bytes(b ^ 1 if b > 0x40 else b for b in want)
        s3.client().put_object(Bucket=s3.bucket, Key="out/takeover.csv", Body=other)
    os.kill(a.proc.pid, signal.SIGKILL)
    b = replica(start_server, s3, pg_url, tmp_path / "b")
    if replaced:
        job = wait_job(b, jid, "failed", timeout=300)
        assert "already exists" in job["error"], job
        assert s3_get(s3, "out/takeover.csv") == other
        return
    job = wait_job(b, jid, timeout=300)  # B takes the job over once A's lease ran out
    assert job["rows_done"] == N and job["correct"] == fmnist.correct, job
    # the output A put is the job's (B assembled the same bytes): kept, not refused
    assert s3_get(s3, "out/takeover.csv") == want
    assert "byte for byte this job's" in b.stderr
    assert output(b, jid).content == want
    # the parts stayed for B, and went once B recorded the job
    poll(lambda: s3_keys(s3, "out/takeover.csv.chunks/") == [], "the parts are deleted")


def single_runner_job(fmnist):
    """A job over an input.url (no byte ranges to split by: one runner), and
    the loopback server that serves it (close it at the end)."""
    files = LoopbackServer(lambda h: send_file(h, fmnist.dir, h.path))
    return files, {"model": "fashion", "batch_size": 500,
                   "input": {"url": files.url("/" + fmnist.npy.name), "format": "npy"}}


def test_a_single_runner_job_run_by_another_replica_than_took_it(start_server, s3, pg_url,
                                                                tmp_path, fmnist):
    files, spec = single_runner_job(fmnist)
    # B's one runner is busy with X (paced: 5 s per committed batch, so X
    # outlasts all of this however slow the machine) ...
    b = replica(start_server, s3, pg_url, tmp_path / "b", "--allow-private-urls", "1",
                pace_ms=int(5000 * TSCALE))
    deploy_fashion(b)
    x = create_job(b, spec)
    poll(lambda: get_job(b, x)["rows_done"] > 0, "B runs X")
    # ... so the job B takes next is run by A, in A's own store
    a = replica(start_server, s3, pg_url, tmp_path / "a", "--allow-private-urls", "1")
    y = create_job(b, spec)
    job = wait_job(a, y, timeout=300)
    assert job["rows_done"] == N, job
    assert holder_pid(job["owner"]) == a.proc.pid, job
    assert get_job(b, x)["status"] == "running"
    got = s3_get(s3, jobs_key(y, "jsonl"))
    assert got.count(b"\n") == N
    assert (tmp_path / "a" / "jobs" / f"{y}.jsonl").read_bytes() == got
    assert output(b, y).content == got  # B has no copy: from S3
    assert b.request("DELETE", f"/jobs/{x}").status_code == 202
    files.close()


def test_parts_a_stopped_coordinator_left_after_recording_are_swept(start_server, s3, pg_url,
                                                                     tmp_path, fmnist):
    spec = csv_job_in_s3(s3, fmnist, "left.csv", path=f"s3://{s3.bucket}/out/left.csv")
    a = replica(start_server, s3, pg_url, tmp_path / "a",
                env={"MD_TEST_PAUSE_AFTER_RECORD_MS": "600000"})
    deploy_fashion(a)
    jid = create_job(a, spec)
    poll(lambda: get_job(a, jid).get("owner"), "A coordinates the job")
    # B's janitor looks every 0.2 s (a test knob), a few leases after the job ended
    b = replica(start_server, s3, pg_url, tmp_path / "b", env={"MD_TEST_JOB_SWEEP_S": "0.2"})
    poll(lambda: f"job {jid}: recorded; test pause" in a.stderr, "A recorded the job")
    assert get_job(b, jid)["status"] == "succeeded"
    assert s3_keys(s3, "out/left.csv.chunks/"), "the parts are still there"
    os.kill(a.proc.pid, signal.SIGKILL)
    poll(lambda: s3_keys(s3, "out/left.csv.chunks/") == [], "B deletes the parts left")
    poll(lambda: f"job {jid}: the parts its coordinator left are deleted" in b.stderr,
         "B says so")
    assert s3_get(s3, "out/left.csv").count(b"\n") == N + 1  # the output stays


def test_a_single_runner_job_taken_over_starts_over_on_the_new_replica(start_server, s3, pg_url,
                                                                      tmp_path, fmnist):
    files, spec = single_runner_job(fmnist)
    a = replica(start_server, s3, pg_url, tmp_path / "a", "--allow-private-urls", "1",
                pace_ms=int(2000 * TSCALE))
    deploy_fashion(a)
    jid = create_job(a, spec)
    poll(lambda: get_job(a, jid)["rows_done"] > 0, "A committed rows")
    b = replica(start_server, s3, pg_url, tmp_path / "b", "--allow-private-urls", "1")
    os.kill(a.proc.pid, signal.SIGKILL)  # its committed output is on A's disk only
    job = wait_job(b, jid, timeout=300)
    assert job["rows_done"] == N and job["rows_skipped"] == 0, job
    assert "starting it over here" in b.stderr
    rows = [json.loads(line) for line in s3_get(s3, jobs_key(jid, "jsonl")).splitlines()]
    assert [r["index"] for r in rows] == list(range(N))
    assert output(b, jid).content == (tmp_path / "b" / "jobs" / f"{jid}.jsonl").read_bytes()
    files.close()
