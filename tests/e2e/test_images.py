"""
test_images.py - image request bodies on the prediction routes (issue 15),
against the real binary:

- raw PNG and JPEG bodies (Content-Type image/png, application/octet-stream,
  none at all as `curl -T` sends with PUT), multipart forms with several
  images answered in order, TorchServe's /predictions/NAME;
- the answers equal what the same pixels answer as a JSON body of v / 255
  (the FashionMNIST example model, 1e-5), and top_k works as for JSON;
- an RGB model declared with resize + center_crop receives exactly
  torchvision's tensor (a TorchScript identity model answers its input; the
  expected tensors are tests/fixtures/images/expected/*.npy, made by
  torchvision 0.14 in tests/fixtures/make_images.py);
- refusals: a pixel bomb (413, from the header), corrupt and truncated files
  (422 naming the image), a GIF (415), an image sent to a version that
  declares no preprocess.image (422), a form without images (400); the
  server answers normally afterwards.
"""
import io
import json

import numpy as np
import pytest

from conftest import REPO, Server

IMAGES = REPO / "tests" / "fixtures" / "images"
MANIFEST = json.loads((IMAGES / "manifest.json").read_text())
FASHION_PT = REPO / "examples" / "fashion_mnist" / "model.pt"
LABELS = json.loads((REPO / "examples" / "fashion_mnist" / "model.json").read_text())["labels"]
IMAGE_CONFIG = {"input": {"shape": [1, 28, 28], "dtype": "float32"},
                "preprocess": {"image": {"mode": "L"}}, "output": "logits", "labels": LABELS}
PLAIN_CONFIG = {"input": {"shape": [1, 28, 28], "dtype": "float32"}, "output": "logits",
                "labels": LABELS}
TOL = 1e-5


def deploy(srv, name, path, config):
    with open(path, "rb") as f:
        r = srv.request("POST", f"/models/{name}/versions", files={"checkpoint": f},
                        data={"config": json.dumps(config)})
    assert r.status_code == 201, r.text


def fashion_files(kind="fashion", n=6):
    files = sorted((IMAGES / kind).rglob("*.png" if kind == "fashion" else "*.jpg"))
    return files[:n]


def as_json_rows(path):
    """The image's pixels as PIL decodes them, v / 255, as a JSON body."""
    from PIL import Image
    a = np.asarray(Image.open(path).convert("L"), dtype=np.float32) / np.float32(255.0)
    return json.dumps([a.reshape(1, 28, 28).tolist()])


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("images"))
    try:
        s.start()
        deploy(s, "fimg", FASHION_PT, IMAGE_CONFIG)
        deploy(s, "fplain", FASHION_PT, PLAIN_CONFIG)
        yield s
    finally:
        s.finish()


def json_answer(srv, path):
    r = srv.request("POST", "/models/fplain/predict", data=as_json_rows(path),
                    headers={"Content-Type": "application/json"})
    assert r.status_code == 200, r.text
    return r.json()


def test_raw_png_answers_as_its_pixels(srv):
    for path in fashion_files():
        want = json_answer(srv, path)
        r = srv.request("POST", "/models/fimg/predict", data=path.read_bytes(),
                        headers={"Content-Type": "image/png"})
        assert r.status_code == 200, r.text
        got = r.json()
        np.testing.assert_allclose(got["predictions"], want["predictions"], atol=TOL)
        assert got["labels"] == want["labels"]


def test_put_without_content_type_as_curl_T(srv):
    path = fashion_files()[0]
    want = json_answer(srv, path)
    # requests sends no Content-Type for raw bytes, as curl -T does
    r = srv.request("PUT", "/models/fimg/predict?top_k=3", data=path.read_bytes())
    assert r.status_code == 200, r.text
    got = r.json()
    np.testing.assert_allclose(got["predictions"], want["predictions"], atol=TOL)
    assert len(got["labels"][0]) == 3 and len(got["scores"][0]) == 3
    assert got["scores"][0] == sorted(got["scores"][0], reverse=True)


def test_jpeg_as_octet_stream_and_default_version_route(srv):
    path = fashion_files("fashion_jpeg")[0]
    want = json_answer(srv, path)
    r = srv.request("POST", "/models/fimg/versions/1/predict", data=path.read_bytes(),
                    headers={"Content-Type": "application/octet-stream"})
    assert r.status_code == 200, r.text
    np.testing.assert_allclose(r.json()["predictions"], want["predictions"], atol=TOL)


def test_multipart_several_images_in_order(srv):
    paths = [fashion_files()[1], fashion_files("fashion_jpeg")[2], fashion_files()[3]]
    files = [("image", (p.name, p.read_bytes(), "image/png" if p.suffix == ".png" else
                        "image/jpeg")) for p in paths]
    for route in ("/models/fimg/predict", "/predictions/fimg"):
        r = srv.request("POST", route, files=files)
        assert r.status_code == 200, r.text
        got = r.json()["predictions"]
        assert len(got) == 3
        for row, p in zip(got, paths):
            np.testing.assert_allclose([row], json_answer(srv, p)["predictions"], atol=TOL)


def test_rgb_resize_and_crop_are_torchvisions(srv, tmp_path):
    import torch

    class Identity(torch.nn.Module):
        def forward(self, x):
            return x.flatten(1)

    model = tmp_path / "identity.pt"
    torch.jit.script(Identity()).save(str(model))
    for case in ("jpeg_rgb", "rgb_down_big", "rgb_pad", "rgb_to_l"):
        c = next(c for c in MANIFEST["cases"] if c["name"] == case)
        img = {"mode": c["mode"]}
        if c.get("resize") is not None:
            img["resize"] = c["resize"]
        if c.get("center_crop") is not None:
            img["center_crop"] = c["center_crop"]
        name = "id" + case.replace("_", "")
        deploy(srv, name, model, {"input": {"shape": c["shape"]},
                                  "preprocess": {"image": img}, "output": "raw"})
        r = srv.request("POST", f"/models/{name}/predict",
                        data=(IMAGES / c["file"]).read_bytes())
        assert r.status_code == 200, r.text
        want = np.load(IMAGES / "expected" / f"{case}.npy").reshape(1, -1)
        got = np.array(r.json()["predictions"], dtype=np.float32)
        assert got.shape == want.shape
        assert np.abs(got - want).max() <= 1e-6, case


def test_refusals_name_the_image_and_leave_the_server_well(srv):
    bomb = (IMAGES / "bad" / "bomb_100000.png").read_bytes()
    r = srv.request("POST", "/models/fimg/predict", data=bomb,
                    headers={"Content-Type": "image/png"})
    assert r.status_code == 413, r.text
    assert "max_image_pixels" in r.json()["error"]["message"]

    cut = (IMAGES / "bad" / "truncated.png").read_bytes()
    r = srv.request("POST", "/models/fimg/predict", files=[
        ("image", ("ok.png", fashion_files()[0].read_bytes(), "image/png")),
        ("image", ("cut.png", cut, "image/png"))])
    assert r.status_code == 422, r.text
    assert "cut.png" in r.json()["error"]["message"]

    r = srv.request("POST", "/models/fimg/predict",
                    data=(IMAGES / "bad" / "image.gif").read_bytes(),
                    headers={"Content-Type": "image/gif"})
    assert r.status_code == 415, r.text

    r = srv.request("POST", "/models/fplain/predict", data=fashion_files()[0].read_bytes(),
                    headers={"Content-Type": "image/png"})
    assert r.status_code == 422, r.text
    assert r.json()["error"]["code"] == "image_not_declared"
    assert "preprocess" in r.json()["error"]["message"]

    r = srv.request("POST", "/models/fimg/predict", files={"top_k": (None, "3")})
    assert r.status_code == 400, r.text

    # and the server answers as before
    path = fashion_files()[0]
    r = srv.request("POST", "/models/fimg/predict", data=path.read_bytes(),
                    headers={"Content-Type": "image/png"})
    assert r.status_code == 200, r.text
    np.testing.assert_allclose(r.json()["predictions"], json_answer(srv, path)["predictions"],
                               atol=TOL)


def scan_bomb(extra):
    """A 28x28 progressive JPEG (PIL writes 6 scans for grayscale) with its last scan
    repeated `extra` times: libjpeg only warns about the repeats and decodes each
    one, a pass over the whole image per scan, as a scan bomb makes it do."""
    from PIL import Image
    a = (np.arange(28 * 28, dtype=np.uint32) * 7 % 251).astype(np.uint8).reshape(28, 28)
    buf = io.BytesIO()
    Image.fromarray(a, mode="L").save(buf, "JPEG", progressive=True, quality=90)
    d = buf.getvalue()
    i, sos, eoi = 2, [], None
    while i + 1 < len(d):
        assert d[i] == 0xFF
        m = d[i + 1]
        if m == 0xD9:
            eoi = i
            break
        seg = 2 + (d[i + 2] << 8 | d[i + 3])
        if m != 0xDA:
            i += seg
            continue
        sos.append(i)
        i += seg  # then the entropy-coded data, up to the next marker
        while not (d[i] == 0xFF and d[i + 1] != 0 and not 0xD0 <= d[i + 1] <= 0xD7):
            i += 1
    assert eoi and len(sos) >= 2, (eoi, sos)
    return d[:eoi] + d[sos[-1]:eoi] * extra + d[eoi:], len(sos) + extra


def test_jpeg_scan_bomb_is_refused_under_max_jpeg_scans(tmp_path):
    bomb, scans = scan_bomb(700)
    plain, _ = scan_bomb(0)
    for limit, want in ((None, 422), (scans - 1, 422), (scans, 200)):
        (tmp_path / f"limit{limit}").mkdir()
        s = Server(tmp_path / f"limit{limit}",
                   args=() if limit is None else ("--max-jpeg-scans", limit))
        try:
            s.start()
            deploy(s, "fimg", FASHION_PT, IMAGE_CONFIG)
            r = s.request("POST", "/models/fimg/predict", data=bomb,
                          headers={"Content-Type": "image/jpeg"})
            assert r.status_code == want, (limit, r.text)
            if want == 422:
                e = r.json()["error"]
                assert e["code"] == "invalid_image", e
                shown = 500 if limit is None else limit
                assert f"more than {shown} scans" in e["message"], e
                assert "max_jpeg_scans" in e["message"], e
            # the same image without the repeats answers under every limit
            r = s.request("POST", "/models/fimg/predict", files=[
                ("image", ("ok.jpg", plain, "image/jpeg"))])
            assert r.status_code == 200, r.text
        finally:
            s.finish()
