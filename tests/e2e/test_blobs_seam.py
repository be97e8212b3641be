"""
test_blobs_seam.py - the blobs seam's conformance suite (tests/test_blobs.c)
against the S3 backend: s3rver behind the SigV4-checking proxy, through
tests/with_s3.sh. `make unit` runs the same suite against the directory.
"""
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_the_conformance_suite_against_s3():
    binary = Path(os.environ.get("BLOBS_TEST_BIN") or REPO / "build/tests/test_blobs")
    if not binary.is_file():
        pytest.fail("%s is missing: run `make build/tests/test_blobs` (make e2e does)" % binary)
    r = subprocess.run([str(REPO / "tests/with_s3.sh"), str(binary)], capture_output=True,
                       text=True, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-6000:]
    assert "blobs backend: s3://" in out, out[-2000:]
    assert "[  PASSED  ] 7 test(s)." in out and "SKIPPED" not in out, out[-4000:]
