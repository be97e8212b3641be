"""
test_predict.py - online predictions against the real binary: every request
dialect (rows, TF Serving instances, Ray Serve array, NPY in and out, a single
row), every way requests are batched (concurrent single rows, requests split
past max_batch_size, a batching delay), the Open Inference Protocol V2 routes,
labels and top_k on the FashionMNIST example, input errors with the row and
column named, a full queue (503), a timeout (504), a hot swap under load, a
restart, and checkpoints or configs that cannot serve (422).

Expected outputs are the committed fixtures computed by Torch
(tests/fixtures/*_expected.*); every comparison allows 1e-5.
"""
import gzip
import io
import json
import signal
import socket
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import requests

from conftest import REPO, TSCALE

FIXTURES = REPO / "tests" / "fixtures"
MLP_PT = FIXTURES / "mlp.pt"
CNN_PT = FIXTURES / "cnn.pt"
ZIP_NOT_TS = FIXTURES / "zip_not_torchscript.pt"
FASHION_PT = REPO / "examples" / "fashion_mnist" / "model.pt"
FASHION_CONFIG = json.loads((REPO / "examples" / "fashion_mnist" / "model.json").read_text())
DATASET = "/usr/share/datasets/fashion-mnist"

MLP_IN = json.loads((FIXTURES / "mlp_input.json").read_text())          # [5, 4]
MLP_OUT = np.array(json.loads((FIXTURES / "mlp_expected.json").read_text()), dtype=np.float32)
CNN_IN = json.loads((FIXTURES / "cnn_input.json").read_text())          # [3, 1, 8, 8]
CNN_OUT = np.array(json.loads((FIXTURES / "cnn_expected.json").read_text()), dtype=np.float32)
MLP_NPY = (FIXTURES / "mlp_input.npy").read_bytes()
CNN_NPY = (FIXTURES / "cnn_input.npy").read_bytes()

MLP_CONFIG = {"input": {"shape": [4]}, "output": "logits"}
CNN_CONFIG = {"input": {"shape": [1, 8, 8]}}
TOL = 1e-5

MODELS = {
    "mlp": (MLP_PT, MLP_CONFIG, MLP_IN, MLP_OUT, MLP_NPY),
    "cnn": (CNN_PT, CNN_CONFIG, CNN_IN, CNN_OUT, CNN_NPY),
}


# ---------------------------------------------------------------- helpers


def deploy(srv, name, path=MLP_PT, config=MLP_CONFIG, **fields):
    """POST /models/NAME/versions as curl -F checkpoint=@... -F config=... does."""
    data = {"config": json.dumps(config)} if config is not None else {}
    data.update({k: (v if isinstance(v, str) else json.dumps(v)) for k, v in fields.items()})
    with open(path, "rb") as f:
        r = requests.post(srv.url + f"/models/{name}/versions", files={"checkpoint": f},
                          data=data, timeout=30 * TSCALE)
    return r


def deployed(srv, name, path=MLP_PT, config=MLP_CONFIG, **fields):
    r = deploy(srv, name, path, config, **fields)
    assert r.status_code == 201, f"deploy {name}: expected 201, got {r.status_code}: {r.text!r}"
    return r.json()


def post_json(srv, path, body, session=None, **kw):
    kw.setdefault("timeout", 10 * TSCALE)
    headers = kw.pop("headers", {})
    headers.setdefault("Content-Type", "application/json")
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return (session or requests).post(srv.url + path, data=data, headers=headers, **kw)


def predictions(resp, name=None, rows=None):
    assert resp.status_code == 200, f"expected 200, got {resp.status_code}: {resp.text!r}"
    ctype = resp.headers.get("Content-Type", "").split(";")[0].strip()
    assert ctype == "application/json", f"Content-Type {ctype!r}"
    body = resp.json()
    if name is not None:
        assert body["model"] == name, body
    assert isinstance(body["version"], int), body
    p = np.array(body["predictions"], dtype=np.float32)
    if rows is not None:
        assert p.shape[0] == rows, f"expected {rows} rows, got shape {p.shape}: {resp.text!r}"
    return p


def assert_close(got, want, what=""):
    got = np.asarray(got, dtype=np.float32)
    want = np.asarray(want, dtype=np.float32)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != expected {want.shape}"
    diff = float(np.max(np.abs(got - want))) if got.size else 0.0
    assert diff <= TOL, f"{what}: max abs diff {diff} > {TOL}\ngot {got}\nwant {want}"


def expect_error(resp, status, code=None):
    assert resp.status_code == status, \
        f"expected {status} {code}, got {resp.status_code}: {resp.text!r}"
    ctype = resp.headers.get("Content-Type", "").split(";")[0].strip()
    assert ctype == "application/json", f"error with Content-Type {ctype!r}: {resp.text!r}"
    body = resp.json()
    assert isinstance(body, dict) and isinstance(body.get("error"), dict), \
        f"not a JSON error body: {resp.text!r}"
    err = body["error"]
    assert isinstance(err.get("message"), str) and err["message"], resp.text
    if code is not None:
        assert err.get("code") == code, f"expected code {code}, got {err.get('code')}: {resp.text!r}"
    return err


def expect_v2_error(resp, status):
    assert resp.status_code == status, f"expected {status}, got {resp.status_code}: {resp.text!r}"
    body = resp.json()
    assert isinstance(body, dict) and set(body) == {"error"} and isinstance(body["error"], str) \
        and body["error"], f"not a V2 error body {{\"error\": \"...\"}}: {resp.text!r}"
    return body["error"]


def blob_names(srv):
    d = srv.store / "blobs"
    return sorted(p.name for p in d.iterdir()) if d.is_dir() else []


def flat(rows):
    return np.asarray(rows, dtype=np.float32).reshape(-1).tolist()


# ---------------------------------------------------------------- dialects


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_every_dialect(server, name):
    path, config, rows, want, npy = MODELS[name]
    deployed(server, name, path, config)
    n = len(rows)
    url = f"/models/{name}/predict"
    arr = np.asarray(rows, dtype=np.float32)

    assert_close(predictions(post_json(server, url, rows), name, n), want, "bare rows")
    assert_close(predictions(post_json(server, url, {"instances": rows}), name, n), want,
                 "instances")
    assert_close(predictions(post_json(server, url, {"array": flat(rows), "shape": list(arr.shape)}),
                             name, n), want, "array flat + shape")
    assert_close(predictions(post_json(server, url, {"array": rows}), name, n), want,
                 "array nested")
    # the default model answers /predict too (only one is deployed)
    assert_close(predictions(post_json(server, "/predict", rows), name, n), want, "/predict")
    # and the version route
    assert_close(predictions(post_json(server, f"/models/{name}/versions/1/predict", rows), name, n),
                 want, "versions/1/predict")

    # NPY request
    r = server.request("POST", url, data=npy, headers={"Content-Type": "application/x-npy"})
    assert_close(predictions(r, name, n), want, "NPY request")

    # NPY response
    r = post_json(server, url, rows, headers={"Accept": "application/x-npy"})
    assert r.status_code == 200, r.text
    assert r.headers.get("Content-Type", "").startswith("application/x-npy"), r.headers
    got = np.load(io.BytesIO(r.content), allow_pickle=False)
    assert got.dtype == np.float32, got.dtype
    assert_close(got, want, "NPY response")

    # NPY in and out
    r = server.request("POST", url, data=npy,
                       headers={"Content-Type": "application/x-npy", "Accept": "application/x-npy"})
    assert r.status_code == 200, r.text
    assert_close(np.load(io.BytesIO(r.content), allow_pickle=False), want, "NPY in and out")

    # float64 NPY is cast
    buf = io.BytesIO()
    np.save(buf, arr.astype(np.float64))
    r = server.request("POST", url, data=buf.getvalue(),
                       headers={"Content-Type": "application/x-npy"})
    assert_close(predictions(r, name, n), want, "NPY float64")

    # one row in the declared shape: a batch of one
    for i in range(n):
        p = predictions(post_json(server, url, rows[i]), name, 1)
        assert_close(p, want[i:i + 1], f"single row {i}")

    # rows given flat are reshaped to the declared row shape
    flat_rows = arr.reshape(n, -1).tolist()
    assert_close(predictions(post_json(server, url, flat_rows), name, n), want, "flat rows")


def test_full_precision_json_reads_the_same_floats_as_npy(server):
    """What clients send: json.dumps(x.tolist()) of a float32 tensor writes
    every value with up to 17 digits (0.0039215688593685627). The JSON
    decoder must read back exactly the float32 values the NPY body carries,
    so both answers are equal bit for bit."""
    deployed(server, "mlp")
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((64, 4)) * 10.0 ** rng.integers(-40, 7, (64, 4))).astype(np.float32)
    x[0] = [np.float32(1) / np.float32(255), -0.0, np.float32(1e-45), np.float32(1.17549435e-38)]
    x[1] = [np.float32(16777217.0), np.float32(0.1), np.float32(-123456.789), np.float32(3e-39)]
    body = json.dumps(x.tolist())
    assert "0.00392156" in body and len(body) > 64 * 4 * 15  # long digit strings
    accept = {"Accept": "application/x-npy"}
    r = server.request("POST", "/models/mlp/predict", data=body,
                       headers={"Content-Type": "application/json", **accept})
    assert r.status_code == 200, r.text
    from_json = np.load(io.BytesIO(r.content), allow_pickle=False)
    buf = io.BytesIO()
    np.save(buf, x)
    r = server.request("POST", "/models/mlp/predict", data=buf.getvalue(),
                       headers={"Content-Type": "application/x-npy", **accept})
    assert r.status_code == 200, r.text
    from_npy = np.load(io.BytesIO(r.content), allow_pickle=False)
    assert from_json.shape == (64, from_npy.shape[1])
    assert from_json.tobytes() == from_npy.tobytes()


def test_single_row_literal(server):
    deployed(server, "mlp")
    p = predictions(post_json(server, "/models/mlp/predict", [1, 2, 3, 4]), "mlp", 1)
    q = predictions(post_json(server, "/models/mlp/predict", [[1, 2, 3, 4]]), "mlp", 1)
    assert p.shape == (1, 3)
    assert_close(p, q, "[1,2,3,4] vs [[1,2,3,4]]")


# ---------------------------------------------------------------- batching


def test_concurrent_single_rows(server):
    deployed(server, "mlp")
    deployed(server, "cnn", CNN_PT, CNN_CONFIG)

    def one(i):
        with requests.Session() as s:
            if i % 4 == 3:
                j = i % len(CNN_IN)
                r = post_json(server, "/models/cnn/predict", [CNN_IN[j]], session=s)
                return i, "cnn", j, r
            j = i % len(MLP_IN)
            r = post_json(server, "/models/mlp/predict", [MLP_IN[j]], session=s)
            return i, "mlp", j, r

    with ThreadPoolExecutor(max_workers=32) as ex:
        results = list(ex.map(one, range(64)))
    for i, name, j, r in results:
        want = (CNN_OUT if name == "cnn" else MLP_OUT)[j:j + 1]
        assert_close(predictions(r, name, 1), want, f"request {i} ({name} row {j})")


def test_request_larger_than_max_batch_is_split_in_order(server):
    deployed(server, "mlp", config={**MLP_CONFIG, "batching": {"max_batch_size": 2}, "workers": 2})
    r = post_json(server, "/models/mlp/predict", MLP_IN)
    assert_close(predictions(r, "mlp", 5), MLP_OUT, "5 rows with max_batch_size 2")

    # several split requests at once, each with its rows in a different order
    perms = [np.random.RandomState(k).permutation(5).tolist() for k in range(16)]

    def one(perm):
        return perm, post_json(server, "/models/mlp/predict", [MLP_IN[i] for i in perm])

    with ThreadPoolExecutor(max_workers=16) as ex:
        for perm, r in ex.map(one, perms):
            assert_close(predictions(r, "mlp", 5), MLP_OUT[perm], f"permutation {perm}")

    # NPY and a larger request: 40 rows, 20 pieces
    big = np.tile(np.asarray(MLP_IN, dtype=np.float32), (8, 1))
    buf = io.BytesIO()
    np.save(buf, big)
    r = server.request("POST", "/models/mlp/predict", data=buf.getvalue(),
                       headers={"Content-Type": "application/x-npy"})
    assert_close(predictions(r, "mlp", 40), np.tile(MLP_OUT, (8, 1)), "40 rows")


def test_max_delay_with_concurrent_clients(server):
    deployed(server, "mlp", config={**MLP_CONFIG, "batching": {"max_delay_us": 20000}})

    def one(i):
        rows = [MLP_IN[(i + k) % 5] for k in range(1 + i % 3)]
        want = MLP_OUT[[(i + k) % 5 for k in range(1 + i % 3)]]
        return i, want, post_json(server, "/models/mlp/predict", rows)

    with ThreadPoolExecutor(max_workers=16) as ex:
        results = list(ex.map(one, range(48)))
    for i, want, r in results:
        assert_close(predictions(r, "mlp", len(want)), want, f"request {i}")


# ---------------------------------------------------------------- V2


def test_v2_infer(server):
    deployed(server, "mlp")
    url = "/v2/models/mlp/infer"

    def infer(data, shape, datatype="FP32", **extra):
        body = {"inputs": [{"name": "input0", "shape": shape, "datatype": datatype, "data": data}]}
        body.update(extra)
        return post_json(server, url, body)

    def outputs(r, rows):
        assert r.status_code == 200, f"expected 200, got {r.status_code}: {r.text!r}"
        body = r.json()
        assert body["model_name"] == "mlp", body
        assert body["model_version"] == "1", body
        out = body["outputs"]
        assert isinstance(out, list) and len(out) == 1, body
        o = out[0]
        assert isinstance(o["name"], str) and o["name"], o
        assert o["shape"] == [rows, 3], o
        assert o["datatype"] == "FP32", o
        assert isinstance(o["data"], list) and len(o["data"]) == rows * 3, o
        return body, np.array(o["data"], dtype=np.float32).reshape(rows, 3)

    _, got = outputs(infer(flat(MLP_IN), [5, 4]), 5)
    assert_close(got, MLP_OUT, "V2 FP32 flat")
    _, got = outputs(infer(MLP_IN, [5, 4]), 5)
    assert_close(got, MLP_OUT, "V2 FP32 nested")
    _, got = outputs(infer(MLP_IN, [5, 4], "FP64"), 5)
    assert_close(got, MLP_OUT, "V2 FP64")
    body, got = outputs(infer(flat(MLP_IN[2:3]), [1, 4], id="req-42"), 1)
    assert body.get("id") == "req-42", body
    assert_close(got, MLP_OUT[2:3], "V2 one row with id")
    r = post_json(server, "/v2/models/mlp/versions/1/infer",
                  {"inputs": [{"name": "x", "shape": [5, 4], "datatype": "FP32",
                               "data": flat(MLP_IN)}]})
    assert_close(outputs(r, 5)[1], MLP_OUT, "V2 versions/1/infer")

    # INT64: the same integers through /predict as floats give the reference
    ints = [[1, 2, 3, 4], [0, -1, 5, 2], [7, 0, -3, 1]]
    ref = predictions(post_json(server, "/models/mlp/predict", ints), "mlp", 3)
    _, got = outputs(infer(ints, [3, 4], "INT64"), 3)
    assert_close(got, ref, "V2 INT64")
    _, got = outputs(infer(sum(ints, []), [3, 4], "INT64"), 3)
    assert_close(got, ref, "V2 INT64 flat")


def test_v2_metadata_and_health(server):
    r = server.get("/v2/health/live")
    assert r.status_code == 200 and r.json() == {"live": True}, r.text
    r = server.get("/v2/health/ready")
    assert r.status_code == 200 and r.json() == {"ready": True}, r.text
    r = server.get("/v2")
    assert r.status_code == 200, r.text
    meta = r.json()
    assert meta["name"] == "modeld" and isinstance(meta["version"], str) \
        and isinstance(meta["extensions"], list), meta

    deployed(server, "mlp")
    r = server.get("/v2/models/mlp")
    assert r.status_code == 200, r.text
    m = r.json()
    assert m["name"] == "mlp", m
    assert "1" in m["versions"], m
    assert isinstance(m["platform"], str) and m["platform"], m
    assert m["inputs"][0]["datatype"] == "FP32", m
    assert m["inputs"][0]["shape"] == [-1, 4], m
    assert isinstance(m["outputs"], list) and m["outputs"], m
    r = server.get("/v2/models/mlp/versions/1")
    assert r.status_code == 200 and r.json()["name"] == "mlp", r.text

    r = server.get("/v2/models/mlp/ready")
    assert r.status_code == 200, r.text
    assert r.json()["ready"] is True, r.text
    r = server.get("/v2/models/mlp/versions/1/ready")
    assert r.status_code == 200, r.text
    assert r.json()["ready"] is True, r.text


def test_v2_errors(server):
    deployed(server, "mlp")
    good = {"inputs": [{"name": "input0", "shape": [1, 4], "datatype": "FP32",
                        "data": [1, 2, 3, 4]}]}
    msg = expect_v2_error(post_json(server, "/v2/models/nope/infer", good), 404)
    assert "nope" in msg, msg
    expect_v2_error(server.get("/v2/models/nope"), 404)
    expect_v2_error(server.get("/v2/models/nope/ready"), 404)

    bad_type = {"inputs": [{"name": "input0", "shape": [1, 4], "datatype": "BYTES",
                            "data": ["a", "b", "c", "d"]}]}
    msg = expect_v2_error(post_json(server, "/v2/models/mlp/infer", bad_type), 400)
    assert "BYTES" in msg, msg
    bad_count = {"inputs": [{"name": "input0", "shape": [2, 4], "datatype": "FP32",
                             "data": [1, 2, 3, 4]}]}
    expect_v2_error(post_json(server, "/v2/models/mlp/infer", bad_count), 400)
    expect_v2_error(post_json(server, "/v2/models/mlp/infer", b"{not json"), 400)
    expect_v2_error(post_json(server, "/v2/models/mlp/infer", {"inputs": []}), 400)
    wrong_width = {"inputs": [{"name": "input0", "shape": [1, 3], "datatype": "FP32",
                               "data": [1, 2, 3]}]}
    expect_v2_error(post_json(server, "/v2/models/mlp/infer", wrong_width), 400)


# ---------------------------------------------------------------- labels and top_k


def read_idx(path, kind, count):
    with gzip.open(path, "rb") as f:
        if kind == "images":
            magic, n, rows, cols = struct.unpack(">IIII", f.read(16))
            assert magic == 2051, magic
            return np.frombuffer(f.read(count * rows * cols), dtype=np.uint8).reshape(count,
                                                                                      rows * cols)
        magic, n = struct.unpack(">II", f.read(8))
        assert magic == 2049, magic
        return np.frombuffer(f.read(count), dtype=np.uint8)


def softmax(x):
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def test_fashion_mnist_labels_and_top_k(server):
    images = read_idx(f"{DATASET}/t10k-images-idx3-ubyte.gz", "images", 5)
    truth = read_idx(f"{DATASET}/t10k-labels-idx1-ubyte.gz", "labels", 5)
    names = FASHION_CONFIG["labels"]
    deployed(server, "fashion", FASHION_PT, FASHION_CONFIG)
    rows = images.astype(int).tolist()  # raw 0..255 pixels; the server applies preprocess.scale

    r = post_json(server, "/models/fashion/predict", rows)
    p = predictions(r, "fashion", 5)
    assert p.shape == (5, 10)
    body = r.json()
    top1 = [names[int(i)] for i in np.argmax(p, axis=1)]
    want = [names[int(i)] for i in truth]
    assert sum(a == b for a, b in zip(top1, want)) >= 4, f"predicted {top1}, dataset says {want}"
    assert isinstance(body.get("labels"), list) and len(body["labels"]) == 5, body
    for i in range(5):
        assert body["labels"][i] == [top1[i]], f"row {i}: labels {body['labels'][i]} != [{top1[i]}]"
    assert len(body["scores"]) == 5 and all(len(s) == 1 for s in body["scores"]), body["scores"]
    assert_close(np.array(body["scores"]).reshape(5), softmax(p).max(axis=1), "top-1 scores")

    r = post_json(server, "/models/fashion/predict?top_k=3", rows)
    p3 = predictions(r, "fashion", 5)
    assert_close(p3, p, "predictions with top_k")
    body = r.json()
    probs = softmax(p3)
    for i in range(5):
        labels, scores = body["labels"][i], body["scores"][i]
        assert len(labels) == 3 and len(scores) == 3, f"row {i}: {labels} {scores}"
        assert all(isinstance(x, str) for x in labels), labels
        assert labels[0] == top1[i], f"row {i}: {labels} should start with {top1[i]}"
        assert scores == sorted(scores, reverse=True), f"row {i}: scores not descending {scores}"
        assert sum(scores) <= 1 + 1e-6, f"row {i}: scores sum to {sum(scores)}"
        order = np.argsort(-probs[i])[:3]
        assert labels == [names[int(j)] for j in order], f"row {i}: {labels}"
        assert_close(scores, probs[i][order], f"row {i} top-3 scores")

    # preprocess.scale is applied: the same model without it, fed pixels/255, agrees
    raw_config = {k: v for k, v in FASHION_CONFIG.items() if k != "preprocess"}
    deployed(server, "fashion_raw", FASHION_PT, raw_config)
    scaled = (images.astype(np.float32) / 255.0).tolist()
    q = predictions(post_json(server, "/models/fashion_raw/predict", scaled), "fashion_raw", 5)
    diff = float(np.max(np.abs(q - p)))
    assert diff <= 1e-4, f"scaled server-side vs client-side differ by {diff}"

    expect_error(post_json(server, "/models/fashion/predict?top_k=0", rows), 400, "invalid_top_k")


# ---------------------------------------------------------------- input errors


def test_input_errors(server):
    deployed(server, "mlp")
    url = "/models/mlp/predict"

    err = expect_error(post_json(server, url, b"[[1,2,3,4],[1,2,3]]"), 400, "invalid_input")
    assert "row 1" in err["message"], err

    err = expect_error(post_json(server, url, b'[[1,2,3,4],[1,2,"x",4]]'), 400, "invalid_input")
    assert "row 1" in err["message"] and "column 2" in err["message"], err

    err = expect_error(post_json(server, url, b"[[1,2,3,4],[NaN,2,3,4]]"), 400)
    assert "row 1" in err["message"], err
    expect_error(post_json(server, url, b"[[1,2,3,4],[Infinity,2,3,4]]"), 400)

    err = expect_error(post_json(server, url, [[1, 2, 3], [4, 5, 6]]), 400, "wrong_shape")
    assert "4" in err["message"], err
    expect_error(post_json(server, url, [1, 2, 3]), 400, "wrong_shape")

    expect_error(server.request("POST", url, data=b""), 400)
    expect_error(post_json(server, url, b""), 400)
    expect_error(post_json(server, url, b"[]"), 400)

    err = expect_error(post_json(server, url, {"inputs": MLP_IN}), 400, "unknown_field")
    assert "inputs" in err["message"], err

    for bad in (b"[[1,2,3,4]", b"[[1,2,3,4]] trailing", b'{"instances" [[1,2,3,4]]}', b"{bad}",
                b"[[1,,2,3,4]]", b'{"instances": [[1,2,3,4]]'):
        expect_error(post_json(server, url, bad), 400)

    r = server.request("POST", url, data=b"NOTNUMPY" + MLP_NPY[8:],
                       headers={"Content-Type": "application/x-npy"})
    expect_error(r, 400)
    buf = io.BytesIO()
    np.save(buf, np.array([[1, np.nan, 2, 3]], dtype=np.float32))
    expect_error(server.request("POST", url, data=buf.getvalue(),
                                headers={"Content-Type": "application/x-npy"}), 400)
    buf = io.BytesIO()
    np.save(buf, np.zeros((5, 3), dtype=np.float32))
    expect_error(server.request("POST", url, data=buf.getvalue(),
                                headers={"Content-Type": "application/x-npy"}), 400, "wrong_shape")

    r = server.request("POST", url, data=b"1,2,3,4\n", headers={"Content-Type": "text/csv"})
    expect_error(r, 415)

    expect_error(post_json(server, "/models/nope/predict", MLP_IN), 404, "model_not_found")
    expect_error(post_json(server, "/models/mlp/versions/9/predict", MLP_IN), 404)

    # the server still answers correctly after all of that
    assert_close(predictions(post_json(server, url, MLP_IN), "mlp", 5), MLP_OUT, "after errors")


def test_no_default_model_with_two_deployed(server):
    expect_error(post_json(server, "/predict", MLP_IN), 400, "no_default_model")
    deployed(server, "mlp")
    deployed(server, "cnn", CNN_PT, CNN_CONFIG)
    err = expect_error(post_json(server, "/predict", MLP_IN), 400, "no_default_model")
    assert "mlp" in err["message"] and "cnn" in err["message"], err


def test_default_model_flag(start_server):
    s = start_server("--default-model", "cnn")
    deployed(s, "mlp")
    deployed(s, "cnn", CNN_PT, CNN_CONFIG)
    assert_close(predictions(post_json(s, "/predict", CNN_IN), "cnn", 3), CNN_OUT,
                 "/predict with --default-model cnn")


def test_body_over_max_body_bytes(start_server):
    s = start_server("--max-body-bytes", "2000")
    deployed(s, "mlp")
    rows = [[0.015625, 0.25, 0.5, 0.75]] * 200  # well over 2000 bytes
    body = json.dumps(rows).encode()
    assert len(body) > 4000
    expect_error(post_json(s, "/models/mlp/predict", body), 413)
    # a body under the limit still works
    assert_close(predictions(post_json(s, "/models/mlp/predict", MLP_IN), "mlp", 5), MLP_OUT,
                 "small body")


# ---------------------------------------------------------------- overload and timeouts


def test_queue_full_answers_503(server):
    deployed(server, "mlp", config={**MLP_CONFIG, "workers": 1,
                                    "batching": {"queue_limit": 1, "max_delay_us": 200000,
                                                 "max_batch_size": 64}})
    barrier = threading.Barrier(20)

    def one(i):
        barrier.wait(5)
        return i, post_json(server, "/models/mlp/predict", [MLP_IN[i % 5]])

    with ThreadPoolExecutor(max_workers=20) as ex:
        results = list(ex.map(one, range(20)))
    busy = 0
    for i, r in results:
        if r.status_code == 503:
            expect_error(r, 503, "overloaded")
            assert r.headers.get("Retry-After"), f"503 without Retry-After: {r.headers}"
            busy += 1
        else:
            assert_close(predictions(r, "mlp", 1), MLP_OUT[i % 5:i % 5 + 1], f"request {i}")
    assert busy >= 1, f"no 503 among 20 concurrent requests with queue_limit 1: " \
                      f"{[r.status_code for _, r in results]}"


def test_timeout_answers_504(server):
    deployed(server, "mlp", config={**MLP_CONFIG, "workers": 1,
                                    "batching": {"timeout_ms": 1, "max_delay_us": 300000}})
    barrier = threading.Barrier(10)

    def one(i):
        barrier.wait(5)
        return i, post_json(server, "/models/mlp/predict", [MLP_IN[i % 5]])

    with ThreadPoolExecutor(max_workers=10) as ex:
        results = list(ex.map(one, range(10)))
    timeouts = 0
    for i, r in results:
        if r.status_code == 504:
            expect_error(r, 504, "timeout")
            timeouts += 1
        else:
            assert_close(predictions(r, "mlp", 1), MLP_OUT[i % 5:i % 5 + 1], f"request {i}")
    assert timeouts >= 1, f"no 504 among 10 requests with timeout_ms 1: " \
                          f"{[(r.status_code, r.text) for _, r in results]}"


# ---------------------------------------------------------------- hot swap and restart


def test_hot_swap_under_load(server):
    deployed(server, "mlp")
    stop = threading.Event()
    lock = threading.Lock()
    seen = {"ok": 0, "versions": set(), "failures": []}

    def client(k):
        with requests.Session() as s:
            i = k
            while not stop.is_set():
                j = i % 5
                i += 1
                try:
                    r = post_json(server, "/models/mlp/predict", [MLP_IN[j]], session=s)
                except requests.RequestException as e:
                    with lock:
                        seen["failures"].append(repr(e))
                    continue
                with lock:
                    if r.status_code != 200:
                        seen["failures"].append(f"{r.status_code} {r.text}")
                        continue
                    body = r.json()
                    seen["versions"].add(body["version"])
                    got = np.array(body["predictions"], dtype=np.float32)
                    if got.shape != (1, 3) or np.max(np.abs(got - MLP_OUT[j:j + 1])) > TOL:
                        seen["failures"].append(f"wrong answer for row {j}: {r.text}")
                    else:
                        seen["ok"] += 1

    threads = [threading.Thread(target=client, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    try:
        time.sleep(0.5)
        v2 = deployed(server, "mlp", make_default="true")
        assert v2["version"] == 2, v2
        time.sleep(1.0)
        r = server.request("PATCH", "/models/mlp", json={"default_version": 1})
        assert r.status_code == 200, r.text
        assert r.json()["default_version"] == 1, r.text
        time.sleep(1.5)
    finally:
        stop.set()
        for t in threads:
            t.join(10)
    assert not seen["failures"], f"{len(seen['failures'])} failed requests, first: " \
                                 f"{seen['failures'][:3]}"
    assert seen["ok"] > 50, seen["ok"]
    assert seen["versions"] <= {1, 2}, seen["versions"]
    assert seen["versions"] == {1, 2}, f"versions seen during the swap: {seen['versions']}"
    r = post_json(server, "/models/mlp/predict", MLP_IN)
    assert_close(predictions(r, "mlp", 5), MLP_OUT, "after the swap")
    assert r.json()["version"] == 1, r.text


def test_restart_reloads_default(start_server):
    s = start_server()
    deployed(s, "mlp")
    deployed(s, "cnn", CNN_PT, CNN_CONFIG)
    assert s.stop(signal.SIGTERM) == 0
    s2 = start_server(store=s.store)
    deadline = time.monotonic() + 10 * TSCALE
    while True:
        r = s2.get("/readyz")
        if r.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert r.status_code == 200, f"/readyz after restart: {r.status_code} {r.text!r}"
    # ready means loaded: no retry needed
    assert_close(predictions(post_json(s2, "/models/mlp/predict", MLP_IN), "mlp", 5), MLP_OUT,
                 "mlp after restart")
    assert_close(predictions(post_json(s2, "/models/cnn/predict", CNN_IN), "cnn", 3), CNN_OUT,
                 "cnn after restart")
    r = s2.get("/v2/models/mlp/ready")
    assert r.status_code == 200 and r.json()["ready"] is True, r.text


# ---------------------------------------------------------------- deployments that cannot serve


def assert_nothing_stored(srv, name):
    expect_error(srv.get(f"/models/{name}"), 404, "model_not_found")
    assert blob_names(srv) == [], f"blobs left behind: {blob_names(srv)}"
    expect_error(post_json(srv, f"/models/{name}/predict", MLP_IN), 404, "model_not_found")


def test_zip_not_torchscript_is_422(server):
    r = deploy(server, "mlp", ZIP_NOT_TS, MLP_CONFIG)
    expect_error(r, 422)
    assert_nothing_stored(server, "mlp")


def test_wrong_input_shape_fails_test_forward(server):
    r = deploy(server, "mlp", MLP_PT, {"input": {"shape": [5]}})
    err = expect_error(r, 422, "model_test_failed")
    assert "shape" in err["message"], err
    assert_nothing_stored(server, "mlp")


@pytest.mark.parametrize("device", ["cuda", "cuda:99"])
def test_cuda_device_unavailable(server, run_modeld, device):
    """A CUDA device that cannot be had is a 422. "cuda" is refused by a CPU
    build (CI's); a CUDA build on a GPU machine serves it (bench/gpu_check.sh
    checks that), so there only "cuda:99", which no machine has, is tested."""
    if device == "cuda" and "CUDA" in run_modeld("--version").stdout:
        pytest.skip("this modeld is built with CUDA: \"cuda\" may be served")
    r = deploy(server, "mlp", MLP_PT, {**MLP_CONFIG, "device": device})
    err = expect_error(r, 422, "cuda_unavailable")
    assert "CUDA" in err["message"], err
    assert_nothing_stored(server, "mlp")
    # the same checkpoint deploys fine on the CPU afterwards
    deployed(server, "mlp")
    assert_close(predictions(post_json(server, "/models/mlp/predict", MLP_IN), "mlp", 5), MLP_OUT,
                 "cpu after the cuda refusal")


def test_client_disconnect_while_queued_and_batch_stats(server):
    """A client that hangs up while its request waits in the queue is dropped
    cleanly and never computed: the server answers everyone else, logs the
    request as 499, and the batcher's counters (batch sizes, queue waits,
    client_closed) show what happened."""
    deployed(server, "mlp", config={**MLP_CONFIG, "workers": 1,
                                    "batching": {"max_delay_us": 300000, "max_batch_size": 64}})
    body = json.dumps([MLP_IN[0]]).encode()
    # three clients send and hang up at once, while the batch waits 300 ms
    for _ in range(3):
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        sock.sendall(b"POST /models/mlp/predict HTTP/1.1\r\nHost: x\r\nX-Request-Id: gone\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
                     + body)
        sock.close()
    # a patient client in the same window gets its exact answer
    r = post_json(server, "/models/mlp/predict", [MLP_IN[0]])
    assert r.status_code == 200, r.text
    assert_close(predictions(r), MLP_OUT[:1])
    # the server is healthy and answers more work
    r = post_json(server, "/models/mlp/predict", MLP_IN)
    assert r.status_code == 200
    assert_close(predictions(r), MLP_OUT)
    # the hung-up requests are in the access log as 499 (client closed)
    deadline = time.time() + 5 * TSCALE
    gone = []
    while time.time() < deadline:
        lines = [json.loads(l) for l in server.access_log.read_text().splitlines() if l.strip()]
        gone = [l for l in lines if l["request_id"] == "gone"]
        if len(gone) == 3:
            break
        time.sleep(0.1)
    assert len(gone) == 3 and all(l["status"] == 499 for l in gone), gone
    # batch sizes and queue waits are observable per loaded version
    info = requests.get(server.url + "/models/mlp", timeout=5).json()
    (stats,) = info["loaded"]
    assert stats["version"] == 1 and stats["default"] is True
    assert stats["requests"] == 5
    assert stats["client_closed"] == 3, "the hung-up requests were not computed"
    assert stats["rows"] == 6, "only the patient clients' rows were computed"
    assert stats["batches"] < stats["requests"], "the delay should have merged requests"
    assert sum(stats["batch_size_histogram"]) == stats["batches"]
    assert stats["queue_wait_us_total"] >= 200000, "requests waited for the batch delay"


# ---------------------------------------------------------------- libtorch's reasons


def test_failed_test_forward_says_why(server):
    """A deploy whose test forward fails answers libtorch's reason (which shapes
    did not match, and in which operation), not only "The following operation
    failed in the TorchScript interpreter.", and logs libtorch's whole message."""
    err = expect_error(deploy(server, "why", config={"input": {"shape": [3]}}), 422,
                       "model_test_failed")
    msg = err["message"]
    assert "mat1 and mat2 shapes cannot be multiplied (1x3 and 4x8)" in msg, msg
    assert "torch.linear" in msg and "config.input.shape" in msg, msg
    assert "The following operation failed" not in msg, msg
    log = server.stderr
    assert "libtorch said: The following operation failed in the TorchScript interpreter." \
        in log and "Traceback of TorchScript" in log, log[-2000:]
    # the whole message is one log line (newlines escaped)
    line = next(l for l in log.splitlines() if "libtorch said" in l)
    assert "RuntimeError: mat1 and mat2 shapes cannot be multiplied" in line, line


def test_failed_forward_of_a_request_says_why(server):
    """A config-less model given rows of the wrong width answers the reason."""
    deployed(server, "nocfg", config=None)
    r = post_json(server, "/models/nocfg/predict", [[1, 2, 3]])
    err = expect_error(r, 422)
    assert "mat1 and mat2 shapes cannot be multiplied (1x3 and 4x8)" in err["message"], err


def fashion_image():
    """The first FashionMNIST test image (examples/fashion_mnist/row.json) as
    x.tolist() gives it for one image: 28 lists of 28 pixel values."""
    row = json.loads((REPO / "examples" / "fashion_mnist" / "row.json").read_text())[0]
    return [row[i * 28:(i + 1) * 28] for i in range(28)]


def test_one_image_as_a_28x28_array_is_one_row(server):
    """Issue 29: x.tolist() of one FashionMNIST image is a 28x28 nested array.
    A version whose config declares input.shape [1, 28, 28] takes it as ONE
    row (its shape is the declared one without the leading 1), in every row
    form of /predict, and answers what PyTorch does for that image; it was
    read as 28 rows of 28 values and refused (400)."""
    import torch

    cfg = {**FASHION_CONFIG, "input": {"shape": [1, 28, 28]}, "prepack": False}
    deployed(server, "img", FASHION_PT, cfg)
    img = fashion_image()
    scale = torch.tensor(FASHION_CONFIG["preprocess"]["scale"], dtype=torch.float32)
    with torch.no_grad():
        want = torch.jit.load(str(FASHION_PT)).eval()(
            torch.tensor(img, dtype=torch.float32).reshape(1, 1, 28, 28) * scale).numpy()
    # the same image as one flat row of 784 (reshaped to [1, 1, 28, 28])
    flat_row = predictions(post_json(server, "/models/img/predict", flat(img)), "img", 1)
    assert_close(flat_row, want, "one flat row of 784")
    npy = io.BytesIO()
    np.save(npy, np.asarray(img, dtype=np.float32))
    forms = {
        "bare array": post_json(server, "/models/img/predict", img),
        "instances": post_json(server, "/models/img/predict", {"instances": img}),
        "array": post_json(server, "/models/img/predict", {"array": img}),
        "array and shape": post_json(server, "/models/img/predict",
                                     {"array": flat(img), "shape": [28, 28]}),
        "npy": server.request("POST", "/models/img/predict", data=npy.getvalue(),
                              headers={"Content-Type": "application/x-npy"}),
    }
    for what, r in forms.items():
        got = predictions(r, "img", 1)
        assert_close(got, want, what)
        assert np.array_equal(got, flat_row), what
        assert r.json()["labels"] == [["Ankle boot"]], (what, r.text)
    r = post_json(server, "/v1/models/img:predict", {"instances": img})
    assert r.status_code == 200, r.text
    assert_close(r.json()["predictions"], want, "KServe V1 instances")
    # two images are two rows, as before
    two = predictions(post_json(server, "/models/img/predict", [img, img]), "img", 2)
    assert_close(two, np.concatenate([want, want]), "two images")
    # a 27x28 array is neither: refused, saying how one row may be sent
    err = expect_error(post_json(server, "/models/img/predict", img[:27]), 400, "wrong_shape")
    assert "expects rows of shape [1, 28, 28] (784 values)" in err["message"], err
    assert "one row alone may also be sent as an array of shape [28, 28]" in err["message"], err


def test_a_28x28_array_without_a_declared_shape_says_what_was_read(server):
    """Issue 29: without config.input.shape the 28x28 array reaches the model
    as 28 rows of 28 values and fails there. The answer says that first, and
    how to declare the shape, before libtorch's "mat1 and mat2 shapes cannot be
    multiplied"; the status stays a failed forward's (422). Declaring the
    shape as it says makes the same body one row."""
    cfg = {k: v for k, v in FASHION_CONFIG.items() if k != "input"}
    deployed(server, "noshape", FASHION_PT, cfg)
    img = fashion_image()
    err = expect_error(post_json(server, "/models/noshape/predict", img), 422, "unprocessable")
    msg = err["message"]
    assert msg.startswith("modeld read the body as 28 rows of 28 values, as model noshape "
                          "version 1 declares no input.shape."), msg
    assert """-F 'config={"input": {"shape": [1, 28, 28]}}'""" in msg, msg
    assert "mat1 and mat2 shapes cannot be multiplied (28x28 and 784x512)" in msg, msg
    assert msg.index("28 rows of 28 values") < msg.index("mat1 and mat2"), msg
    # the same in the other row forms
    for body in ({"instances": img}, {"array": img}):
        err = expect_error(post_json(server, "/models/noshape/predict", body), 422)
        assert err["message"].startswith("modeld read the body as 28 rows of 28 values"), err
    r = post_json(server, "/v1/models/noshape:predict", {"instances": img})
    assert r.status_code == 422 and "28 rows of 28 values" in r.text, r.text
    # doing what it says
    deployed(server, "noshape", FASHION_PT, {**cfg, "input": {"shape": [1, 28, 28]}})
    p = predictions(post_json(server, "/models/noshape/predict", img), "noshape", 1)
    assert int(np.argmax(p[0])) == FASHION_CONFIG["labels"].index("Ankle boot")


def test_a_bad_row_logs_one_line_with_its_reason(server):
    """Issue 29: a version with no declared shape, whose worker forwards on a
    prepacked copy, sent one row of 783 values: the log had the packed copy's
    own width check first ("split_with_sizes expects split_sizes to sum
    exactly to 783"), unrelated to the user's model, then the real reason.
    One request, one log line, and it holds libtorch's reason."""
    deployed(server, "nocfg", FASHION_PT, {"workers": 1})
    deadline = time.monotonic() + 10 * TSCALE
    while server.get("/models/nocfg").json()["loaded"][0]["prepacked_workers"] != 1:
        assert time.monotonic() < deadline, "the worker did not make its prepacked copy"
        time.sleep(0.02)
    before = server.stderr
    err = expect_error(post_json(server, "/models/nocfg/predict", [[0.5] * 783]), 422)
    assert "mat1 and mat2 shapes cannot be multiplied (1x783 and 784x512)" in err["message"], err
    # the log line is written before the answer is sent
    log = server.stderr
    assert log.startswith(before)
    lines = log[len(before):].splitlines()
    assert len(lines) == 1, lines
    assert " warn " in lines[0], lines
    assert "mat1 and mat2 shapes cannot be multiplied (1x783 and 784x512)" in lines[0], lines
    assert "split_with_sizes" not in log, log[-3000:]


def test_state_dict_upload_says_what_it_is(server):
    """torch.save(model.state_dict()) is a zip but not TorchScript: the answer
    says what the file is and how to export one, not "PytorchStreamReader
    failed locating file constants.pkl"."""
    err = expect_error(deploy(server, "sd", path=FIXTURES / "mlp_state_dict.pt"), 422,
                       "no_architecture")
    assert "torch.save()" in err["message"] and "torch.jit.script(model).save" in err["message"], err
    assert "constants.pkl" not in err["message"], err
    assert requests.get(server.url + "/models/sd", timeout=10 * TSCALE).status_code == 404


# ---------------------------------------------------------------- large JSON bodies


def decoded_off_thread(srv):
    """modeld_http_decoded_off_thread_total from /metrics."""
    for line in srv.get("/metrics", timeout=10 * TSCALE).text.splitlines():
        if line.startswith("modeld_http_decoded_off_thread_total "):
            return float(line.split()[1])
    raise AssertionError("/metrics has no modeld_http_decoded_off_thread_total")


def test_large_json_bodies_decode_off_the_http_thread(server):
    """A JSON body of 64 KiB or more is parsed on the decode pool, not on the
    libmicrohttpd thread that received it: the answer is the same as for the
    same rows in NPY (which, a copy, is decoded in place), errors still name
    their row and column, and many at once from several connections all
    answer right; a body of another type is refused where it is. The
    counter in /metrics says which path each one took."""
    raw_config = {k: v for k, v in FASHION_CONFIG.items() if k != "preprocess"}
    deployed(server, "fashion_raw", FASHION_PT, raw_config)
    x = (read_idx(f"{DATASET}/t10k-images-idx3-ubyte.gz", "images", 64) /
         np.float32(255)).astype(np.float32)
    body = json.dumps(x.tolist())  # what clients send: full-precision floats
    assert len(body) > 64 * 1024
    buf = io.BytesIO()
    np.save(buf, x)
    npy = buf.getvalue()
    assert len(npy) > 64 * 1024

    before = decoded_off_thread(server)
    want = np.load(io.BytesIO(requests.post(
        server.url + "/models/fashion_raw/predict", data=npy, timeout=10 * TSCALE,
        headers={"Content-Type": "application/x-npy", "Accept": "application/x-npy"}).content))
    assert decoded_off_thread(server) == before, "an NPY body went to the decode pool"
    small = json.dumps(x[:2].tolist())
    assert len(small) < 64 * 1024
    assert_close(predictions(post_json(server, "/models/fashion_raw/predict", small), rows=2),
                 want[:2], "2 rows")
    assert decoded_off_thread(server) == before, "a small body went to the decode pool"

    assert_close(predictions(post_json(server, "/models/fashion_raw/predict", body),
                             "fashion_raw", 64), want, "64 rows")
    assert decoded_off_thread(server) == before + 1

    bad = x.tolist()
    bad[63][700] = "x"
    r = post_json(server, "/models/fashion_raw/predict", json.dumps(bad))
    expect_error(r, 400, "invalid_input")
    assert "row 63, column 700" in r.json()["error"]["message"], r.text
    assert decoded_off_thread(server) == before + 2

    # 6 connections x 4 large bodies, small ones between them on another
    def client(i):
        with requests.Session() as s:
            for _ in range(4):
                got = predictions(post_json(server, "/models/fashion_raw/predict", body,
                                            session=s), rows=64)
                assert_close(got, want, f"client {i}")
        return i
    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(client, i) for i in range(6)]
        for _ in range(10):
            assert_close(predictions(post_json(server, "/models/fashion_raw/predict", small),
                                     rows=2), want[:2], "small beside large")
        assert sorted(f.result(timeout=60 * TSCALE) for f in futures) == list(range(6))
    # each went to the pool unless its queue was full (4 a pool thread: a
    # machine of fewer cores may fill it with 6 connections)
    assert before + 2 < decoded_off_thread(server) <= before + 2 + 24

    # a type the decoder does not read as JSON is refused where it stands
    n = decoded_off_thread(server)
    r = post_json(server, "/models/fashion_raw/predict", body, headers={"Content-Type": "text/csv"})
    expect_error(r, 415, "unsupported_media_type")
    assert decoded_off_thread(server) == n
