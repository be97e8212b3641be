"""
test_image_memory.py - an image request costs memory in proportion to its
body, and a body that is not small is decoded off the HTTP thread (issue 24,
amplification 3), against the real binary:

- a 28x28 PNG carrying dozens of zTXt/iTXt chunks that each inflate to ~7 MB
  (libpng used to inflate and keep every one: 4.4 GB from a 4 MB file)
  answers exactly what the same pixels answer without them, with peak RSS
  (VmHWM, reset through /proc/PID/clear_refs) growing by less than 100 MB;
- it is decoded on the decode pool (modeld_http_decoded_off_thread_total),
  as is a JPEG carrying megabytes of COM/APPn segments, while a plain small
  PNG still decodes on the HTTP thread that received it.
"""
import io
import json
import struct
import zlib

import numpy as np
import pytest

from conftest import REPO, TSCALE
from memwatch import MB, PeakGrowth

IMAGES = REPO / "tests" / "fixtures" / "images"
FASHION_PT = REPO / "examples" / "fashion_mnist" / "model.pt"
LABELS = json.loads((REPO / "examples" / "fashion_mnist" / "model.json").read_text())["labels"]
IMAGE_CONFIG = {"input": {"shape": [1, 28, 28], "dtype": "float32"},
                "preprocess": {"image": {"mode": "L"}}, "output": "logits", "labels": LABELS}


def decoded_off_thread(srv):
    for line in srv.get("/metrics", timeout=10 * TSCALE).text.splitlines():
        if line.startswith("modeld_http_decoded_off_thread_total "):
            return float(line.split()[1])
    raise AssertionError("/metrics has no modeld_http_decoded_off_thread_total")


def chunk(tag, data):
    return (struct.pack(">I", len(data)) + tag + data +
            struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF))


def png(pixels, extra=b""):
    """An 8-bit grayscale PNG of `pixels` with `extra` chunks before IDAT."""
    h, w = pixels.shape
    raw = b"".join(b"\0" + row.tobytes() for row in pixels)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 0, 0, 0, 0)) +
            extra + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def text_bomb(count, inflated):
    """`count` compressed text chunks (zTXt, and every fourth an iTXt), each
    inflating to `inflated` bytes: under libpng's default 8 MB chunk limit."""
    payload = zlib.compress(b"A" * inflated, 9)  # text: copied up to a NUL
    out = []
    for i in range(count):
        if i % 4 == 3:
            out.append(chunk(b"iTXt", b"XML:com.adobe.xmp\0\1\0\0\0" + payload))
        else:
            out.append(chunk(b"zTXt", b"Comment %d\0\0" % i + payload))
    return b"".join(out)


@pytest.fixture
def fimg(server):
    with open(FASHION_PT, "rb") as f:
        r = server.request("POST", "/models/fimg/versions", files={"checkpoint": f},
                           data={"config": json.dumps(IMAGE_CONFIG)}, timeout=60 * TSCALE)
    assert r.status_code == 201, r.text
    return server


def predict(srv, body, ctype):
    r = srv.request("POST", "/models/fimg/predict", data=body, headers={"Content-Type": ctype},
                    timeout=60 * TSCALE)
    assert r.status_code == 200, r.text
    return r.json()


def test_png_text_chunks_are_skipped_not_inflated(fimg):
    from PIL import Image
    path = sorted((IMAGES / "fashion").rglob("*.png"))[0]
    pixels = np.asarray(Image.open(path).convert("L"), dtype=np.uint8)
    plain = png(pixels)
    bomb = png(pixels, text_bomb(48, 7_000_000))  # ~336 MB inflated, ~330 KB sent
    assert len(plain) < 8 * 1024 < len(bomb) < 2 * MB
    want = predict(fimg, plain, "image/png")  # warms the model and the decoder up

    before_threads = decoded_off_thread(fimg)
    predict(fimg, plain, "image/png")
    assert decoded_off_thread(fimg) == before_threads, "a small PNG left the HTTP thread"

    with PeakGrowth(fimg.proc.pid) as peak:
        got = predict(fimg, bomb, "image/png")
    assert got == want
    assert peak.bytes < 100 * MB, \
        f"peak RSS grew {peak.bytes / MB:.0f} MB for a {len(bomb)}-byte PNG"
    # decoded on the decode pool, not on the thread that also answers /healthz
    assert decoded_off_thread(fimg) == before_threads + 1
    assert fimg.get("/healthz").status_code == 200


def jpeg_with_segments(pixels, count, size):
    """A baseline JPEG of `pixels` with `count` COM and APP1 segments of
    `size` bytes each after SOI: libjpeg skips them unless told to save them."""
    from PIL import Image
    buf = io.BytesIO()
    Image.fromarray(pixels, mode="L").save(buf, "JPEG", quality=95)
    d = buf.getvalue()
    segs = b"".join(bytes([0xFF, 0xFE if i % 2 else 0xE1]) + struct.pack(">H", size + 2) +
                    bytes([65 + i % 26]) * size for i in range(count))
    return d, d[:2] + segs + d[2:]


def test_jpeg_markers_are_skipped_off_the_http_thread(fimg):
    from PIL import Image
    path = sorted((IMAGES / "fashion").rglob("*.png"))[1]
    pixels = np.asarray(Image.open(path).convert("L"), dtype=np.uint8)
    plain, marked = jpeg_with_segments(pixels, 64, 65000)  # ~4 MB of segments
    want = predict(fimg, plain, "image/jpeg")
    before_threads = decoded_off_thread(fimg)
    with PeakGrowth(fimg.proc.pid) as peak:
        got = predict(fimg, marked, "image/jpeg")
    assert got == want
    assert peak.bytes < 100 * MB, \
        f"peak RSS grew {peak.bytes / MB:.0f} MB for a {len(marked)}-byte JPEG"
    assert decoded_off_thread(fimg) == before_threads + 1
