"""
test_jobs_s3.py - batch jobs over datasets in S3 (issue 26, part 1: inputs and
outputs), against the real binary and a real S3 server (s3rver behind the
SigV4-checking proxy: s3.py), with boto3 putting the data the way users do:

- input.path s3://BUCKET/KEY in every file format (IDX.gz, plain IDX with
  its labels in S3 too, CSV, JSON Lines, NPY), read by Range GETs in pieces
  (MD_TEST_S3_PIECE_BYTES makes them small, so each object takes many): the
  job's accuracy is PyTorch's own count and its output the local job's;
- output.path s3://BUCKET/KEY: one PUT, or a multipart upload past the part
  size (MD_TEST_S3_PART_BYTES), the object byte for byte GET /jobs/ID/output;
  an output that exists already is never replaced;
- an image folder s3://BUCKET/PREFIX/ of PNGs in class folders: the same
  rows, labels and predictions as the same folder on disk, and accuracy
  equal to torchvision's ImageFolder with the model in this process;
- refusals: outside allowed_s3 (input, labels, output, folder) 403
  source_not_allowed, no allowed_s3 at all 403, "..", "." and "//" keys 400,
  a missing object a failed job naming it;
- a Range GET cut mid-way is retried: the job's output is still exact.
"""
import io
import time
import json
import gzip

import numpy as np
import pytest

from test_jobs import (IMAGES_GZ, LABELS_GZ, N, assert_accuracy, assert_done, assert_full_jsonl,
                       create_job, deploy_fashion, err_code, fmnist, jsonl_rows, output,
                       post_job, wait_job)
from test_images_jobs import IMAGE_CONFIG, check_against_torch, folders  # noqa: F401 (fixtures)

assert fmnist  # a fixture, used by name
PIECE = 256 * 1024  # bytes of one Range GET: the 8 MB IDX file takes ~30
PART = 128 * 1024   # bytes of one uploaded part


def s3_server(start_server, s3, *args, env=None):
    e = s3.env()
    e.update({"MD_TEST_S3_PIECE_BYTES": str(PIECE), "MD_TEST_S3_PART_BYTES": str(PART),
              "MD_TEST_S3_STALL_S": "3"})
    e.update(env or {})
    return start_server("--allowed-s3", f"{s3.bucket}/data,{s3.bucket}/out", *args, env=e)


def put(s3, key, path_or_bytes):
    c = s3.client()
    if isinstance(path_or_bytes, (bytes, bytearray)):
        c.put_object(Bucket=s3.bucket, Key=key, Body=bytes(path_or_bytes))
    else:
        c.upload_file(str(path_or_bytes), s3.bucket, key)
    return f"s3://{s3.bucket}/{key}"


def get(s3, key):
    return s3.client().get_object(Bucket=s3.bucket, Key=key)["Body"].read()


def harness(s3):
    import requests
    r = requests.get(s3.endpoint + "/__harness__/stats", timeout=10)
    return dict(kv.split("=") for kv in r.text.split())


@pytest.fixture
def srv(start_server, s3):
    s = s3_server(start_server, s3)
    deploy_fashion(s)
    return s


def test_every_file_format_from_s3_and_output_to_s3(srv, s3, fmnist):
    plain_idx = gzip.decompress(IMAGES_GZ.read_bytes())
    plain_labels = gzip.decompress(LABELS_GZ.read_bytes())
    ranges_before = int(harness(s3)["ranges"])
    specs = {
        "idx.gz": {"path": put(s3, "data/t10k-images.gz", IMAGES_GZ), "format": "idx",
                   "label": put(s3, "data/t10k-labels.gz", LABELS_GZ)},
        "idx": {"path": put(s3, "data/t10k-images", plain_idx), "format": "idx",
                "label": put(s3, "data/t10k-labels", plain_labels)},
        "csv": {"path": put(s3, "data/test.csv", fmnist.csv), "format": "csv", "label": "label"},
        "jsonl": {"path": put(s3, "data/test.jsonl", fmnist.jsonl), "format": "jsonl",
                  "label": "label"},
    }
    jobs = {}
    for name, spec in specs.items():
        jobs[name] = create_job(srv, {"model": "fashion", "input": spec,
                                      "output": {"path": f"s3://{s3.bucket}/out/{name}.jsonl"}})
    for name, jid in jobs.items():
        job = wait_job(srv, jid)
        assert_done(job)
        assert_accuracy(job, fmnist)
        body = output(srv, jid).content
        # the object in S3 is the output, byte for byte
        assert get(s3, f"out/{name}.jsonl") == body, name
        assert_full_jsonl(jsonl_rows(output(srv, jid)), fmnist)
    # read in pieces: the IDX file alone (7.8 MB) takes dozens of Range GETs
    assert int(harness(s3)["ranges"]) - ranges_before > 2 * len(plain_idx) // PIECE

    # NPY in, NPY out: past the part size, so a multipart upload
    parts_before = int(harness(s3)["parts"])
    jid = create_job(srv, {"model": "fashion",
                           "input": {"path": put(s3, "data/test.npy", fmnist.npy),
                                     "format": "npy"},
                           "output": {"path": f"s3://{s3.bucket}/out/logits.npy",
                                      "format": "npy"}})
    job = wait_job(srv, jid)
    assert job["rows_done"] == N and job["rows_total"] == N, job
    body = output(srv, jid, "application/x-npy").content
    assert len(body) > 3 * PART
    assert get(s3, "out/logits.npy") == body
    assert int(harness(s3)["parts"]) - parts_before == (len(body) + PART - 1) // PART
    out = np.load(io.BytesIO(body))
    assert out.shape == (N, 10) and out.dtype == np.float32, out.shape
    assert int((out.argmax(axis=1) == fmnist.labels).sum()) == fmnist.correct


def test_an_output_in_s3_is_never_replaced(srv, s3, fmnist):
    src = put(s3, "data/test.npy", fmnist.npy)
    put(s3, "out/taken.jsonl", b"someone else's\n")
    jid = create_job(srv, {"model": "fashion", "input": {"path": src, "format": "npy"},
                           "output": {"path": f"s3://{s3.bucket}/out/taken.jsonl"}})
    job = wait_job(srv, jid, "failed")
    assert "already exists in S3" in job["error"] and "out/taken.jsonl" in job["error"], job
    assert job["rows_done"] == 0, f"the name is checked before any row is computed: {job}"
    assert get(s3, "out/taken.jsonl") == b"someone else's\n"


def test_refusals_name_the_setting(start_server, srv, s3, fmnist):
    ok = put(s3, "data/test.npy", fmnist.npy)
    put(s3, "private/test.npy", fmnist.npy)
    b = s3.bucket
    cases = [
        ({"path": f"s3://{b}/private/test.npy", "format": "npy"}, None, 403, "source_not_allowed"),
        ({"path": f"s3://{b}/data2/test.npy", "format": "npy"}, None, 403, "source_not_allowed"),
        ({"path": ok, "format": "npy"}, f"s3://{b}/private/x.jsonl", 403, "source_not_allowed"),
        ({"path": ok.replace("data/", "data/../private/"), "format": "npy"}, None, 400,
         "invalid_path"),
        ({"path": ok.replace("data/", "data/./"), "format": "npy"}, None, 400, "invalid_path"),
        ({"path": ok.replace("data/", "data//"), "format": "npy"}, None, 400, "invalid_path"),
        ({"path": f"s3://{b}/data/", "format": "npy"}, None, 400, "invalid_path"),
        ({"path": f"s3://{b}/private/", "format": "images"}, None, 403, "source_not_allowed"),
        ({"path": f"s3://{b}/data/imgs", "format": "images"}, None, 400, "invalid_path"),
        ({"path": f"s3://{b}/data/i", "format": "idx", "label": f"s3://{b}/private/l"}, None,
         403, "source_not_allowed"),
        # an NPZ is a zip read from its end: not a stream, so not from S3 (yet)
        ({"path": f"s3://{b}/data/x.npz", "format": "npz"}, None, 400, "invalid_job"),
    ]
    for inp, out, status, code in cases:
        spec = {"model": "fashion", "input": inp}
        if out:
            spec["output"] = {"path": out}
        r = post_job(srv, spec)
        assert r.status_code == status and err_code(r) == code, (inp, out, r.text)
        if status == 403:
            assert "allowed_s3" in r.json()["error"]["message"], r.text
    # no allowed_s3: every s3:// path refused, saying which setting opens them
    bare = start_server(env=s3.env())
    deploy_fashion(bare)
    r = post_job(bare, {"model": "fashion", "input": {"path": ok, "format": "npy"}})
    assert r.status_code == 403 and err_code(r) == "source_not_allowed", r.text
    assert "allowed_s3" in r.json()["error"]["message"]
    # allowed, but no such object: the job fails naming it
    jid = create_job(srv, {"model": "fashion",
                           "input": {"path": f"s3://{b}/data/missing.npy", "format": "npy"}})
    job = wait_job(srv, jid, "failed")
    assert "no such object" in job["error"] and "data/missing.npy" in job["error"], job


def test_a_cut_range_get_is_retried_and_the_output_is_exact(srv, s3, fmnist):
    src = put(s3, "data/test.csv", fmnist.csv)
    s3.cut_next_get(1000)  # the first piece's answer stops after 1000 bytes
    jid = create_job(srv, {"model": "fashion",
                           "input": {"path": src, "format": "csv", "label": "label"}})
    job = wait_job(srv, jid)
    assert int(harness(s3)["cuts"]) == 1
    assert_done(job)
    assert_accuracy(job, fmnist)
    assert_full_jsonl(jsonl_rows(output(srv, jid)), fmnist)


def test_an_image_folder_in_s3_reads_as_the_same_folder_on_disk(start_server, s3, folders,
                                                                tmp_path):
    root, expected = folders
    local = root / "fashion"
    c = s3.client()
    n = 0
    for f in sorted(local.rglob("*.png")):
        c.upload_file(str(f), s3.bucket, "data/imgs/" + str(f.relative_to(local)))
        n += 1
    c.put_object(Bucket=s3.bucket, Key="data/imgs/README.txt", Body=b"not an image")
    srv = s3_server(start_server, s3, "--allowed-paths", f"{root},{tmp_path}")
    import requests
    from test_jobs import FASHION_PT
    with open(FASHION_PT, "rb") as f:
        r = requests.post(srv.url + "/models/fashion/versions", files={"checkpoint": f},
                          data={"config": json.dumps(IMAGE_CONFIG)}, timeout=60)
    assert r.status_code == 201, r.text
    inc = ["index", "path", "prediction", "label"]
    j_s3 = create_job(srv, {"model": "fashion", "batch_size": 32,
                            "input": {"format": "images", "path": f"s3://{s3.bucket}/data/imgs/"},
                            "output": {"include": inc}})
    j_disk = create_job(srv, {"model": "fashion", "batch_size": 32,
                              "input": {"format": "images", "path": str(local)},
                              "output": {"include": inc}})
    a, b = wait_job(srv, j_s3), wait_job(srv, j_disk)
    assert a["rows_done"] == n and a["files_skipped"] == 1, a
    for k in ("rows_total", "correct", "labeled", "confusion", "accuracy"):
        assert a[k] == b[k], (k, a, b)
    assert output(srv, j_s3).content == output(srv, j_disk).content
    # and both are what torchvision's ImageFolder and the model give in-process
    check_against_torch(a, jsonl_rows(output(srv, j_s3)), expected["fashion"])
    # the copy the reader walked goes with the runner's end of the job
    deadline = time.monotonic() + 30
    while list((srv.store / "jobs").glob("*.images")):
        assert time.monotonic() < deadline, list((srv.store / "jobs").iterdir())
        time.sleep(0.05)
