"""
test_s3_harness.py - the S3 test harness itself (tests/e2e/s3.py,
tests/with_s3.sh): s3rver behind the SigV4-checking proxy.

- boto3 puts a model and a dataset (multipart, past boto3's 8 MB threshold)
  into the bucket the way users do, lists and reads them back;
- what the proxy refuses, as S3 would: a wrong secret (403
  SignatureDoesNotMatch, nothing stored), an unsigned request, a query
  signed in the order it was sent instead of canonical order (the mistake
  libcurl 7.88 makes when not given a canonical query), a body that is not
  the one x-amz-content-sha256 names;
- the C client (build/tests/test_s3_live) through tests/with_s3.sh: put,
  head, get with a cut resumed, paginated list, delete, a wrong secret, and
  s3rver stopped with SIGSTOP.
"""
import hashlib
import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import requests
from botocore.auth import S3SigV4Auth, SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials
from botocore.exceptions import ClientError

REPO = Path(__file__).resolve().parents[2]


def test_boto3_puts_a_model_and_a_dataset_and_lists_them(s3, tmp_path):
    model = tmp_path / "model.pt"
    model.write_bytes(os.urandom(300_000))
    dataset = tmp_path / "train.csv"
    with open(dataset, "w") as f:
        for i in range(450_000):  # ~9 MB: boto3 uploads it in parts
            f.write("%d,%d,%d\n" % (i, i * 7 % 10, i % 3))
    c = s3.client()
    c.upload_file(str(model), s3.bucket, "models/fashion/model.pt")
    c.upload_file(str(dataset), s3.bucket, "datasets/train.csv")
    c.put_object(Bucket=s3.bucket, Key="datasets/notes and $pecial+chars.txt", Body=b"hi")
    listed = c.list_objects_v2(Bucket=s3.bucket, Prefix="datasets/")
    assert [(o["Key"], o["Size"]) for o in listed["Contents"]] == [
        ("datasets/notes and $pecial+chars.txt", 2),
        ("datasets/train.csv", dataset.stat().st_size),
    ]
    got = c.get_object(Bucket=s3.bucket, Key="models/fashion/model.pt")["Body"].read()
    assert got == model.read_bytes()
    body = c.get_object(Bucket=s3.bucket, Key="datasets/train.csv")["Body"].read()
    assert hashlib.sha256(body).digest() == hashlib.sha256(dataset.read_bytes()).digest()
    # a paginated listing through the proxy (the one that needs s3rver's
    # --openssl-legacy-provider)
    pages = list(c.get_paginator("list_objects_v2").paginate(Bucket=s3.bucket,
                                                             PaginationConfig={"PageSize": 1}))
    assert sum(p.get("KeyCount", 0) for p in pages) == 3
    assert len(pages) >= 3


def test_a_wrong_secret_is_refused_and_nothing_is_stored(s3):
    wrong = s3.client(secret="wrong-" + s3.secret)
    with pytest.raises(ClientError) as e:
        wrong.put_object(Bucket=s3.bucket, Key="models/x.pt", Body=b"bytes")
    assert e.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403
    assert e.value.response["Error"]["Code"] == "SignatureDoesNotMatch"
    with pytest.raises(ClientError) as e:
        wrong.list_objects_v2(Bucket=s3.bucket)
    assert e.value.response["Error"]["Code"] == "SignatureDoesNotMatch"
    with pytest.raises(ClientError) as e:
        s3.client().head_object(Bucket=s3.bucket, Key="models/x.pt")
    assert e.value.response["ResponseMetadata"]["HTTPStatusCode"] == 404


def test_an_unsigned_request_is_refused(s3):
    r = requests.get("%s/%s?list-type=2" % (s3.endpoint, s3.bucket), timeout=10)
    assert r.status_code == 403
    assert "<Code>AccessDenied</Code>" in r.text


def _signed(s3, method, url, body=b"", payload_hash=None, query_as_sent=False):
    """Headers signing `url` as botocore does, or (query_as_sent) with the
    query copied into the canonical request unsorted, as libcurl 7.88 does;
    x-amz-content-sha256 is `payload_hash` (default: the body's)."""

    class Signer(S3SigV4Auth):
        def _modify_request_before_signing(self, request):
            SigV4Auth._modify_request_before_signing(self, request)  # keep our payload hash

        def canonical_query_string(self, request):
            if query_as_sent:
                return urlsplit(request.url).query
            return super().canonical_query_string(request)

    req = AWSRequest(method=method, url=url, data=body)
    req.headers["X-Amz-Content-SHA256"] = payload_hash or hashlib.sha256(body).hexdigest()
    Signer(Credentials("S3RVER", s3.secret), "s3", "us-east-1").add_auth(req)
    return dict(req.headers)


def test_a_query_signed_in_sent_order_is_refused(s3):
    url = "%s/%s?prefix=models%%2F&list-type=2" % (s3.endpoint, s3.bucket)
    ok = requests.get(url, headers=_signed(s3, "GET", url), timeout=10)
    assert ok.status_code == 200, ok.text
    bad = requests.get(url, headers=_signed(s3, "GET", url, query_as_sent=True), timeout=10)
    assert bad.status_code == 403
    assert "<Code>SignatureDoesNotMatch</Code>" in bad.text
    # the same query sent in canonical order passes when signed as sent
    url = "%s/%s?list-type=2&prefix=models%%2F" % (s3.endpoint, s3.bucket)
    ok = requests.get(url, headers=_signed(s3, "GET", url, query_as_sent=True), timeout=10)
    assert ok.status_code == 200, ok.text


def test_a_body_that_is_not_the_signed_one_is_refused(s3):
    url = "%s/%s/models/y.pt" % (s3.endpoint, s3.bucket)
    claimed = hashlib.sha256(b"the bytes that were signed").hexdigest()
    r = requests.put(url, data=b"other bytes", timeout=10,
                     headers=_signed(s3, "PUT", url, body=b"other bytes", payload_hash=claimed))
    assert r.status_code == 400
    assert "<Code>XAmzContentSHA256Mismatch</Code>" in r.text
    with pytest.raises(ClientError):
        s3.client().head_object(Bucket=s3.bucket, Key="models/y.pt")


def test_with_s3_sh_exports_the_settings_and_returns_the_status():
    script = ("import os, sys; "
              "assert os.environ['AWS_ENDPOINT_URL_S3'].startswith('http://127.0.0.1:'); "
              "assert os.environ['S3_URL'] == 's3://modeld-test'; "
              "assert os.environ['AWS_SECRET_ACCESS_KEY'] and os.environ['AWS_ACCESS_KEY_ID']; "
              "os.kill(int(os.environ['S3RVER_PID']), 0); "
              "sys.exit(3)")
    r = subprocess.run([str(REPO / "tests/with_s3.sh"), sys.executable, "-c", script],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 3, r.stderr


def test_the_c_client_through_with_s3_sh():
    live = Path(os.environ.get("S3_LIVE_BIN") or REPO / "build/tests/test_s3_live")
    if not live.is_file():
        pytest.fail("%s is missing: run `make build/tests/test_s3_live` (make e2e does)" % live)
    r = subprocess.run([str(REPO / "tests/with_s3.sh"), str(live)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "[  PASSED  ] 6 test(s)." in r.stdout + r.stderr
