"""
test_images_jobs.py - batch jobs over image folders (input.format "images",
issue 15) end to end: examples/fashion_mnist/model.pt deployed with
preprocess.image {"mode": "L"}, a job over FashionMNIST test images exported
as PNG and as JPEG in torchvision's ImageFolder layout (<class>/<class>_<i>.png),
checked against the same work done in this process with torch: torchvision's
ImageFolder (classes sorted), ToTensor, the TorchScript model. Also labels
from a regular expression, files that are not images and symlinks skipped and
counted, a corrupt file as a bad row named by its path, an input outside
allowed_paths refused, and a kill -9 in the middle resumed exactly once.

The images are exported here (PIL) from /usr/share/datasets/fashion-mnist,
the first N_IMAGES of the test set, once per session.
"""
import csv
import io
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import requests

from conftest import REPO, TSCALE
from test_jobs import (FASHION_JSON, FASHION_PT, IMAGES_GZ, LABELS_GZ, create_job, err_code,
                       get_job, jsonl_rows, output, post_job, read_idx_gz, stored_job,
                       wait_job, wait_rows)

N_IMAGES = 200
PACE_MS = 200
LABELS = json.loads(FASHION_JSON.read_text())["labels"]
IMAGE_CONFIG = {"input": {"shape": [1, 28, 28], "dtype": "float32"},
                "preprocess": {"image": {"mode": "L"}}, "output": "logits", "labels": LABELS}


@pytest.fixture(scope="session")
def folders(tmp_path_factory):
    """fashion/<class>/<class>_<i>.png and fashion_jpeg/<class>/<class>_<i>.jpg,
    with what torch itself predicts for each file: {rel path: (label, class)}."""
    from PIL import Image
    root = tmp_path_factory.mktemp("images")
    images = read_idx_gz(IMAGES_GZ)[:N_IMAGES]
    labels = read_idx_gz(LABELS_GZ)[:N_IMAGES]
    for kind, ext in (("fashion", "png"), ("fashion_jpeg", "jpg")):
        for i, (img, y) in enumerate(zip(images, labels)):
            d = root / kind / str(int(y))
            d.mkdir(parents=True, exist_ok=True)
            Image.fromarray(img, mode="L").save(d / f"{int(y)}_{i:05d}.{ext}",
                                                **({"quality": 90} if ext == "jpg" else {}))
    return root, {kind: in_process(root / kind) for kind in ("fashion", "fashion_jpeg")}


def in_process(folder):
    """torchvision ImageFolder + ToTensor + the TorchScript model, in this
    process: {relative path: (label index, predicted class index)}."""
    import torch
    import torchvision
    from PIL import Image
    ds = torchvision.datasets.ImageFolder(
        str(folder), transform=torchvision.transforms.ToTensor(),
        loader=lambda p: Image.open(p).convert("L"))
    model = torch.jit.load(str(FASHION_PT))
    model.eval()
    out = {}
    with torch.no_grad():
        for (path, label), (x, _) in zip(ds.samples, ds):
            pred = int(model(x.unsqueeze(0)).argmax(1)[0])
            out[os.path.relpath(path, folder)] = (label, pred)
    return out


def deploy(srv):
    with open(FASHION_PT, "rb") as f:
        r = requests.post(srv.url + "/models/fashion/versions", files={"checkpoint": f},
                          data={"config": json.dumps(IMAGE_CONFIG)}, timeout=30 * TSCALE)
    assert r.status_code == 201, f"deploy: {r.status_code} {r.text!r}"


@pytest.fixture
def srv(start_server, folders, tmp_path):
    root, _ = folders
    s = start_server("--allowed-paths", f"{root},{tmp_path}")
    deploy(s)
    return s


def check_against_torch(job, rows, expected):
    """Every file exactly once, in byte order of its path, each prediction
    equal to torch's, and the job's accuracy equal to torch's."""
    paths = [row["path"] for row in rows]
    assert paths == sorted(expected, key=lambda p: p.encode()), \
        f"output paths are not the files in sorted order: {paths[:5]}..."
    assert [row["index"] for row in rows] == list(range(len(expected)))
    for row in rows:
        label, pred = expected[row["path"]]
        assert row["label"] == label, f"{row}: torchvision's label is {label}"
        assert row["prediction"] == LABELS[pred], f"{row}: torch predicts {LABELS[pred]}"
    correct = sum(label == pred for label, pred in expected.values())
    assert job["rows_total"] == len(expected) and job["rows_done"] == len(expected), job
    assert job["labeled"] == len(expected) and job["correct"] == correct, \
        f"job counts {job['correct']}/{job['labeled']} right, torch {correct}/{len(expected)}"
    assert job["accuracy"] == pytest.approx(correct / len(expected), abs=1e-12)


@pytest.mark.parametrize("kind", ["fashion", "fashion_jpeg"])
def test_folder_labels_match_torch(srv, folders, kind):
    root, expected = folders
    jid = create_job(srv, {"model": "fashion", "batch_size": 32,
                           "input": {"format": "images", "path": str(root / kind)}})
    job = wait_job(srv, jid)
    assert job["files_skipped"] == 0 and job["rows_skipped"] == 0, job
    check_against_torch(job, jsonl_rows(output(srv, jid)), expected[kind])


def test_regex_labels_and_csv_path_column(srv, folders):
    root, expected = folders
    jid = create_job(srv, {"model": "fashion", "output": {"format": "csv"},
                           "input": {"format": "images", "path": str(root / "fashion"),
                                     "label_from": {"regex": "^([0-9]+)_"}}})
    job = wait_job(srv, jid)
    rows = list(csv.DictReader(io.StringIO(output(srv, jid, "text/csv").text)))
    assert list(rows[0]) == ["index", "path", "prediction", "label"], rows[0]
    got = [{"index": int(r["index"]), "path": r["path"], "prediction": r["prediction"],
            "label": int(r["label"])} for r in rows]
    check_against_torch(job, got, expected["fashion"])


def test_other_files_and_symlinks_skipped_and_counted(srv, folders, tmp_path):
    root, expected = folders
    d = tmp_path / "mixed"
    shutil.copytree(root / "fashion", d)
    (d / "3" / "notes.txt").write_text("not an image\n")
    from PIL import Image
    Image.new("L", (28, 28)).save(d / "3" / "pic.gif")
    (d / "4" / "fake.png").write_bytes(b"GIF89a" + bytes(40))  # named .png, a GIF inside
    os.symlink(root / "fashion" / "1", d / "1_link")            # a folder symlink
    first = sorted((root / "fashion" / "2").iterdir())[0]
    os.symlink(first, d / "2" / "link.png")                     # a file symlink
    (d / ".hidden").mkdir()
    shutil.copy(first, d / ".hidden" / "x.png")                 # hidden: ignored
    shutil.copy(first, d / "2" / ".x.png")
    jid = create_job(srv, {"model": "fashion",
                           "input": {"format": "images", "path": str(d)}})
    job = wait_job(srv, jid)
    assert job["files_skipped"] == 5, f"txt, gif, fake png, two symlinks: {job}"
    rows = jsonl_rows(output(srv, jid))
    check_against_torch(job, rows, expected["fashion"])


def test_corrupt_image_is_a_bad_row_named_by_its_path(srv, folders, tmp_path):
    root, expected = folders
    d = tmp_path / "corrupt"
    shutil.copytree(root / "fashion", d)
    victim = sorted((d / "5").iterdir())[1]
    data = victim.read_bytes()
    victim.write_bytes(data[:len(data) // 2])  # truncated
    rel = f"5/{victim.name}"
    spec = {"model": "fashion", "input": {"format": "images", "path": str(d)}}
    job = wait_job(srv, create_job(srv, spec), want="failed")
    assert rel in job["error"], f"the error does not name {rel}: {job['error']}"
    jid = create_job(srv, {**spec, "on_error": "skip"})
    job = wait_job(srv, jid)
    assert job["rows_skipped"] == 1, job
    rows = jsonl_rows(output(srv, jid))
    assert rel not in [r["path"] for r in rows]
    assert len(rows) == len(expected["fashion"]) - 1


def test_pixel_bomb_is_a_bad_row(srv, folders, tmp_path):
    import struct
    import zlib
    root, _ = folders
    d = tmp_path / "bomb" / "0"
    d.mkdir(parents=True)
    shutil.copy(sorted((root / "fashion" / "0").iterdir())[0], d / "a.png")

    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + \
            struct.pack(">I", zlib.crc32(kind + body) & 0xffffffff)
    ihdr = struct.pack(">IIBBBBB", 100000, 100000, 8, 0, 0, 0, 0)
    (d / "b.png").write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) +
                              chunk(b"IDAT", zlib.compress(b"\0" * 100)) + chunk(b"IEND", b""))
    jid = create_job(srv, {"model": "fashion", "on_error": "skip",
                           "input": {"format": "images", "path": str(d.parent)}})
    job = wait_job(srv, jid)
    assert job["rows_total"] == 2 and job["rows_skipped"] == 1, job
    assert [r["path"] for r in jsonl_rows(output(srv, jid))] == ["0/a.png"]


def test_validation(srv, folders, tmp_path):
    root, _ = folders
    d = str(root / "fashion")
    cases = [
        ("outside allowed_paths", {"format": "images", "path": str(REPO / "examples")},
         400, "path_not_allowed"),
        ("a file, not a directory", {"format": "images", "path": str(FASHION_JSON)},
         400, "path_not_allowed"),
        ("missing", {"format": "images", "path": str(tmp_path / "nope")}, 400,
         "input_not_found"),
        ("bad regex", {"format": "images", "path": d, "label_from": {"regex": "(["}},
         400, "invalid_job"),
        ("bad label_from", {"format": "images", "path": d, "label_from": "parent"},
         400, "invalid_job"),
        ("label for images", {"format": "images", "path": d, "label": "x"}, 400,
         "invalid_job"),
        ("url for images", {"format": "images", "url": "http://example.com/x"}, 400,
         "invalid_job"),
    ]
    for what, inp, status, code in cases:
        r = post_job(srv, {"model": "fashion", "input": inp})
        assert r.status_code == status and err_code(r) == code, \
            f"{what}: expected {status} {code}, got {r.status_code} {r.text!r}"
    link = tmp_path / "link"
    os.symlink(d, link)
    r = post_job(srv, {"model": "fashion", "input": {"format": "images", "path": str(link)}})
    assert r.status_code == 400 and err_code(r) == "path_not_allowed", r.text


def test_model_without_preprocess_image_fails_clearly(start_server, folders):
    root, _ = folders
    s = start_server("--allowed-paths", str(root))
    with open(FASHION_PT, "rb") as f:
        r = requests.post(s.url + "/models/plain/versions", files={"checkpoint": f},
                          data={"config": FASHION_JSON.read_text()}, timeout=30 * TSCALE)
    assert r.status_code == 201, r.text
    jid = create_job(s, {"model": "plain",
                         "input": {"format": "images", "path": str(root / "fashion")}})
    job = wait_job(s, jid, want="failed")
    assert "preprocess.image" in job["error"], job


def test_kill9_mid_job_resumes_exactly_once(start_server, folders, tmp_path):
    root, expected = folders
    args = ("--allowed-paths", f"{root},{tmp_path}")
    s = start_server(*args, "--test-job-chunk-delay-ms", str(PACE_MS))
    deploy(s)
    jid = create_job(s, {"model": "fashion", "batch_size": 8,
                         "input": {"format": "images", "path": str(root / "fashion")}})
    job = wait_rows(s, jid, at_least=3 * 8)
    assert job["status"] == "running" and 0 < job["rows_done"] < N_IMAGES, \
        f"could not catch the job in the middle: {job}"
    s.proc.kill()
    s.proc.wait(10)
    s.kill()
    stored = stored_job(s.store, jid)
    assert stored["status"] == "running" and stored["rows_done"] < N_IMAGES, stored
    s2 = start_server(*args)
    job = wait_job(s2, jid)
    rows = jsonl_rows(output(s2, jid))
    paths = [r["path"] for r in rows]
    assert len(paths) == len(set(paths)), "a file appears twice after the restart"
    check_against_torch(job, rows, expected["fashion"])
