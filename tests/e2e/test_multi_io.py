"""
test_multi_io.py - models with several inputs and outputs (issue 27), end to
end against the real binary, with PyTorch itself as the oracle.

The models are tests/fixtures/multi_io/*.pt (made by
tests/fixtures/make_multi_io.py): the issue's two-input tabular model
(numeric float32 [4] + an int64 category through nn.Embedding(10, 3), answering
a tuple (logits [3], embedding [8])), the same with one output, a one-input
model answering a tuple, one answering a Dict[str, Tensor], a sequence with a
bool mask answering a dict with a scalar per row, and an int64 model whose
answer changes if an id is read through a float (2**53 + 1). Every expected
value is what torch.jit.load of the same file computes here, in-process;
answers must match within 1e-5.

Covered: deploys with declared inputs/outputs and GET /v2/models/NAME;
every request dialect of the spec (rows as objects, {"instances": [objects]},
columnar {"inputs": {...}}, NPZ bodies from np.savez and np.savez_compressed,
KServe V1 objects, V2 with several inputs as JSON or binary in any order, V2
output selection, binary outputs); every input dtype (float32, float64,
int64 exact to 2**63 - 1, int32, uint8, bool) and an int64 output;
per-input preprocess; labels/top_k on the "logits": true output; batches
mixing request forms (deterministic: one worker, a long max_delay_us and a
max_batch_size equal to the rows sent, so the forward runs when the batch
is full), a request split past max_batch_size, and 8 threads of mixed
requests; a restart; deploy-time 422s; request 400s that name the input;
the single-input forms (regression); and batch jobs (CSV and JSON Lines
with input.columns, NPZ datasets, one field / column / NPY file per
output, a malformed integer cell).

Spec decisions where /work/notes/spec27.md leaves room (what a TF Serving or
Triton user expects):
- request errors are 400 with code `invalid_input` (the code the JSON
  decoder uses today); `wrong_shape` and `unknown_field` are accepted where
  the existing API uses them for the same thing, and the spec's `bad_input`.
- an NPZ body may be answered either as rows (`predictions`) or columns
  (`outputs`); only the values are checked.
- V2 answers every declared output in declared order, as Triton answers in
  the model config's order; a V2 datatype other than the declared dtype
  (FP64 for float32 too) is 400, as Triton refuses it.
- job output for several outputs: JSON Lines has a field NAME per output
  (beside index/prediction/label), CSV has NAME_0..NAME_k columns, and
  `"format": "npy"` with `output.path` writes a folder PATH holding NAME.npy.
"""
import csv
import functools
import io
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import requests
import torch

from conftest import REPO, TSCALE, Server

FIX = REPO / "tests" / "fixtures" / "multi_io"
MLP_PT = REPO / "tests" / "fixtures" / "mlp.pt"
TOL = 1e-5
BIG = 9007199254740993  # 2**53 + 1: a float64 reads it as 2**53
LABELS = ["a", "b", "c"]
JOB_TIMEOUT = 60.0

torch.set_num_threads(1)

TAB_INPUTS = [{"name": "numeric", "shape": [4], "dtype": "float32"},
              {"name": "category", "shape": [], "dtype": "int64"}]
TAB_OUTPUTS = [{"name": "logits", "logits": True, "shape": [3]},
               {"name": "embedding", "shape": [8], "dtype": "float32"}]
TAB_CONFIG = {"inputs": TAB_INPUTS, "outputs": TAB_OUTPUTS, "labels": LABELS}
TAB_NAMES = ["logits", "embedding"]

# the 400 codes a request error may carry (see the docstring)
BAD = {"invalid_input", "bad_input"}
BAD_SHAPE = BAD | {"wrong_shape"}
BAD_KEY = BAD | {"unknown_field"}
# a deploy whose declared outputs do not fit what the model returns (spec)
MISMATCH = {"invalid_config", "model_mismatch"}
# a deploy whose test forward fails on the declared inputs (libtorch's reason;
# model_test_failed is today's code for a failed test forward)
FORWARD_FAILS = MISMATCH | {"model_test_failed"}


# ---------------------------------------------------------------- the oracle


@functools.lru_cache(maxsize=None)
def jit(name):
    m = torch.jit.load(str(FIX / f"{name}.pt") if name != "mlp" else str(MLP_PT))
    m.eval()
    return m


def oracle(name, *inputs, names=None):
    """What PyTorch answers for these numpy inputs: a dict name -> float32
    array for a tuple (named by `names`) or dict result, else one array."""
    with torch.no_grad():
        out = jit(name)(*[torch.from_numpy(np.ascontiguousarray(a)) for a in inputs])
    if isinstance(out, dict):
        return {k: v.numpy().astype(np.float32) for k, v in out.items()}
    if isinstance(out, (tuple, list)):
        assert names is not None and len(names) == len(out)
        return {n: v.numpy().astype(np.float32) for n, v in zip(names, out)}
    return out.numpy().astype(np.float32)


def tab(numeric, category):
    return oracle("tabular", numeric, category, names=TAB_NAMES)


def rng_rows(seed, n):
    """n rows of the tabular model: numeric on a 1/64 grid in [-2, 2) (exact
    in float32 and JSON), categories 0..9."""
    g = np.random.default_rng(seed)
    numeric = (g.integers(-128, 128, size=(n, 4)) / 64.0).astype(np.float32)
    category = g.integers(0, 10, size=n).astype(np.int64)
    return numeric, category


NUM, CAT = rng_rows(27, 6)
CAT[:] = [3, 0, 9, 5, 1, 7]  # every row a different category, 0 and 9 included


# ---------------------------------------------------------------- helpers


def deploy(srv, name, fixture, config, **params):
    path = FIX / f"{fixture}.pt" if fixture != "mlp" else MLP_PT
    with open(path, "rb") as f:
        return requests.post(srv.url + f"/models/{name}/versions", params=params,
                             files={"checkpoint": f},
                             data={"config": json.dumps(config)} if config is not None else {},
                             timeout=60 * TSCALE)


def deployed(srv, name, fixture, config, **params):
    r = deploy(srv, name, fixture, config, **params)
    assert r.status_code == 201, f"deploy {name} {config}: {r.status_code} {r.text}"
    return r.json()


def post(srv, path, body, headers=None, **kw):
    kw.setdefault("timeout", 30 * TSCALE)
    h = {"Content-Type": "application/json"}
    h.update(headers or {})
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return requests.post(srv.url + path, data=data, headers=h, **kw)


def npz_bytes(compressed=False, **arrays):
    buf = io.BytesIO()
    (np.savez_compressed if compressed else np.savez)(buf, **arrays)
    return buf.getvalue()


def post_npz(srv, path, compressed=False, **arrays):
    return post(srv, path, npz_bytes(compressed, **arrays),
                headers={"Content-Type": "application/x-npz"})


def objects(numeric, category):
    """Rows as objects keyed by input name."""
    return [{"numeric": n.tolist(), "category": int(c)} for n, c in zip(numeric, category)]


def columns(numeric, category):
    return {"inputs": {"numeric": numeric.tolist(), "category": category.tolist()}}


def ok_json(r, what):
    assert r.status_code == 200, f"{what}: expected 200, got {r.status_code}: {r.text!r}"
    ctype = r.headers.get("Content-Type", "").split(";")[0].strip()
    assert ctype == "application/json", f"{what}: Content-Type {ctype!r}"
    return r.json()


def assert_close(got, want, what):
    got = np.asarray(got, dtype=np.float32)
    want = np.asarray(want, dtype=np.float32)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != expected {want.shape}: {got}"
    diff = float(np.max(np.abs(got - want))) if got.size else 0.0
    assert diff <= TOL, f"{what}: max abs diff {diff} > {TOL}\ngot  {got}\nwant {want}"


def assert_outputs(got, want, what):
    """got, want: dict name -> array (or one array each)."""
    if not isinstance(want, dict):
        assert_close(got, want, what)
        return
    assert isinstance(got, dict) and set(got) == set(want), \
        f"{what}: outputs {sorted(got) if isinstance(got, dict) else got!r}, expected {sorted(want)}"
    for k in want:
        assert_close(got[k], want[k], f"{what}, output {k!r}")


def rows_answer(body, names, n, what):
    """`predictions` of a rows request: one object per row with every output
    (several outputs), gathered into name -> array."""
    p = body.get("predictions")
    assert isinstance(p, list) and len(p) == n, f"{what}: predictions {body!r}"
    for i, row in enumerate(p):
        assert isinstance(row, dict) and set(row) == set(names), \
            f"{what}: row {i} is {row!r}, expected an object with {names}"
    return {k: np.array([row[k] for row in p], dtype=np.float32) for k in names}


def columns_answer(body, names, what):
    out = body.get("outputs")
    assert isinstance(out, dict) and set(out) == set(names), f"{what}: outputs {body!r}"
    return {k: np.array(out[k], dtype=np.float32) for k in names}


def any_answer(body, names, n, what):
    """An NPZ answer: rows (`predictions`) or columns (`outputs`)."""
    if "outputs" in body:
        return columns_answer(body, names, what)
    return rows_answer(body, names, n, what)


def error(r, status, codes, *words):
    """A modeld JSON error: status, one of `codes`, every word in the message."""
    assert r.status_code == status, f"expected {status} {sorted(codes)}, got {r.status_code}: {r.text!r}"
    ctype = r.headers.get("Content-Type", "").split(";")[0].strip()
    assert ctype == "application/json", f"error with Content-Type {ctype!r}: {r.text!r}"
    err = r.json().get("error")
    assert isinstance(err, dict) and isinstance(err.get("message"), str), r.text
    assert err.get("code") in codes, f"code {err.get('code')!r} not in {sorted(codes)}: {r.text!r}"
    for w in words:
        assert w in err["message"], f"{w!r} not in the message: {err['message']!r}"
    return err


def v2_error(r, status, *words):
    """A V2/KServe V1 error: {"error": "message"}."""
    assert r.status_code == status, f"expected {status}, got {r.status_code}: {r.text!r}"
    body = r.json()
    assert isinstance(body, dict) and isinstance(body.get("error"), str), r.text
    for w in words:
        assert w in body["error"], f"{w!r} not in the message: {body['error']!r}"
    return body["error"]


V2_TYPES = {"FP32": np.float32, "FP64": np.float64, "INT64": np.int64, "INT32": np.int32,
            "UINT8": np.uint8, "BOOL": np.bool_}


def v2_input(name, arr, datatype, binary=False):
    """One V2 input: (its JSON object, its raw bytes or b"")."""
    a = np.asarray(arr).astype(V2_TYPES[datatype])
    d = {"name": name, "shape": list(a.shape), "datatype": datatype}
    if binary:
        raw = a.tobytes()
        d["parameters"] = {"binary_data_size": len(raw)}
        return d, raw
    d["data"] = a.flatten().tolist()
    return d, b""


def v2_body(inputs, outputs=None, binary_outputs=False, **extra):
    """A V2 request from v2_input()s, with the binary extension when any
    input is binary or binary outputs are asked for: (body, headers)."""
    req = {"inputs": [d for d, _ in inputs], **extra}
    if outputs is not None:
        req["outputs"] = [{"name": o, **({"parameters": {"binary_data": True}}
                                         if binary_outputs else {})} for o in outputs]
    elif binary_outputs:
        req["parameters"] = {"binary_data_output": True}
    raw = b"".join(r for _, r in inputs)
    head = json.dumps(req).encode()
    if not raw and not binary_outputs:
        return head, {"Content-Type": "application/json"}
    return head + raw, {"Content-Type": "application/octet-stream",
                        "Inference-Header-Content-Length": str(len(head))}


def v2_outputs(r, what):
    """A V2 answer (JSON or binary outputs): (header, [(name, array)] in order)."""
    assert r.status_code == 200, f"{what}: expected 200, got {r.status_code}: {r.text!r}"
    if "Inference-Header-Content-Length" in r.headers:
        n = int(r.headers["Inference-Header-Content-Length"])
        head, rest = json.loads(r.content[:n]), r.content[n:]
    else:
        head, rest = r.json(), b""
    got = []
    at = 0
    for o in head["outputs"]:
        assert o["datatype"] == "FP32", f"{what}: {o}"
        if "data" in o:
            a = np.array(o["data"], dtype=np.float32)
        else:
            size = o["parameters"]["binary_data_size"]
            a = np.frombuffer(rest[at:at + size], dtype="<f4")
            at += size
        got.append((o["name"], a.reshape(o["shape"])))
    assert at == len(rest), f"{what}: {len(rest) - at} bytes after the outputs"
    return head, got


def tab_v2(numeric, category, order=("numeric", "category"), binary=(), **kw):
    parts = {"numeric": v2_input("numeric", numeric, "FP32", "numeric" in binary),
             "category": v2_input("category", category, "INT64", "category" in binary)}
    return v2_body([parts[k] for k in order], **kw)


def softmax(x):
    x = np.asarray(x, dtype=np.float64)
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def top(logits, k):
    """(labels, scores) as modeld answers them for `logits` and top_k=k."""
    p = softmax(logits)
    order = np.argsort(-p, axis=1, kind="stable")[:, :k]
    return ([[LABELS[j] for j in row] for row in order],
            [[float(p[i, j]) for j in row] for i, row in enumerate(order)])


def close_scores(got, want):
    """modeld's scores (float32 probabilities) are the softmax's, 1e-5 relative."""
    g, w = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    return g.shape == w.shape and bool(np.allclose(g, w, rtol=1e-5, atol=1e-6))


def loaded_stats(srv, name):
    info = srv.get(f"/models/{name}").json()
    (stats,) = info["loaded"]
    return stats


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def tab_server(tmp_path_factory):
    """One server with the tabular model deployed as "tab" (labels on its
    logits), for tests that only send requests (the 400s)."""
    s = Server(tmp_path_factory.mktemp("multi_io"))
    try:
        s.start()
        deployed(s, "tab", "tabular", TAB_CONFIG)
        yield s
    finally:
        s.finish()


def test_fixture_rows_sit_on_no_boundary():
    """top_k orders are compared exactly: no two logits of a row may be
    nearly equal, or the server's last bits could swap them."""
    for seed, (numeric, category) in (("NUM", (NUM, CAT)), (1, rng_rows(1, 40)),
                                      (5, rng_rows(5, 300))):
        lg = np.sort(tab(numeric, category)["logits"], axis=1)
        assert np.diff(lg, axis=1).min() > 1e-4, f"seed {seed}: a row's logits nearly tie"
    for name in ("argmax", "dict"):
        lg = np.sort(oracle(name, NUM, names=["logits", "class"])["logits"], axis=1)
        assert np.diff(lg, axis=1).min() > 1e-4, f"{name}: a row's logits nearly tie"


# ---------------------------------------------------------------- deploy, metadata


def test_deploy_and_v2_metadata(server):
    body = deployed(server, "tab", "tabular", TAB_CONFIG)
    assert body["model"] == "tab" and body["version"] == 1, body
    r = server.get("/v2/models/tab")
    m = ok_json(r, "V2 metadata")
    assert m["name"] == "tab" and "1" in m["versions"], m
    assert [(i["name"], i["datatype"], i["shape"]) for i in m["inputs"]] == \
        [("numeric", "FP32", [-1, 4]), ("category", "INT64", [-1])], m
    assert [(o["name"], o["datatype"], o["shape"]) for o in m["outputs"]] == \
        [("logits", "FP32", [-1, 3]), ("embedding", "FP32", [-1, 8])], m
    m1 = ok_json(server.get("/v2/models/tab/versions/1"), "V2 version metadata")
    assert m1["inputs"] == m["inputs"] and m1["outputs"] == m["outputs"], m1


def test_v2_metadata_of_other_dtypes(server):
    deployed(server, "seq", "seqmask", {
        "inputs": [{"name": "seq", "shape": [3, 2]}, {"name": "mask", "shape": [3], "dtype": "bool"}],
        "outputs": [{"name": "pooled", "shape": [2]}, {"name": "count", "shape": []}]})
    m = ok_json(server.get("/v2/models/seq"), "V2 metadata")
    assert [(i["name"], i["datatype"], i["shape"]) for i in m["inputs"]] == \
        [("seq", "FP32", [-1, 3, 2]), ("mask", "BOOL", [-1, 3])], m
    assert [(o["name"], o["datatype"], o["shape"]) for o in m["outputs"]] == \
        [("pooled", "FP32", [-1, 2]), ("count", "FP32", [-1])], m


# ---------------------------------------------------------------- /predict dialects


def test_rows_as_objects(server):
    deployed(server, "tab", "tabular", TAB_CONFIG)
    want = tab(NUM, CAT)
    labels, scores = top(want["logits"], 1)
    n = len(CAT)
    for path in ("/models/tab/predict", "/predict", "/models/tab/versions/1/predict"):
        for form, body in (("rows", objects(NUM, CAT)),
                           ("instances", {"instances": objects(NUM, CAT)})):
            what = f"{form} to {path}"
            b = ok_json(post(server, path, body), what)
            assert b["model"] == "tab" and b["version"] == 1, b
            assert_outputs(rows_answer(b, TAB_NAMES, n, what), want, what)
            assert b["labels"] == labels, f"{what}: {b}"
            assert close_scores(b["scores"], scores), f"{what}: {b}"
    # TF Serving's signature_name is ignored
    b = ok_json(post(server, "/models/tab/predict",
                     {"signature_name": "serving_default", "instances": objects(NUM, CAT)}),
                "signature_name")
    assert_outputs(rows_answer(b, TAB_NAMES, n, "signature_name"), want, "signature_name")
    # keys in any order within a row, and one row alone
    body = [{"category": int(CAT[2]), "numeric": NUM[2].tolist()}]
    b = ok_json(post(server, "/models/tab/predict", body), "one row, keys reversed")
    assert_outputs(rows_answer(b, TAB_NAMES, 1, "one row"), tab(NUM[2:3], CAT[2:3]), "one row")
    # a leading zero is not JSON
    r = post(server, "/models/tab/predict", '[{"numeric": [1, 2, 3, 4], "category": 03}]')
    assert r.status_code == 400, r.text


def test_columnar_inputs(server):
    deployed(server, "tab", "tabular", TAB_CONFIG)
    want = tab(NUM, CAT)
    labels, scores = top(want["logits"], 1)
    b = ok_json(post(server, "/models/tab/predict", columns(NUM, CAT)), "columnar")
    assert b["model"] == "tab" and b["version"] == 1, b
    assert "predictions" not in b, b
    assert_outputs(columns_answer(b, TAB_NAMES, "columnar"), want, "columnar")
    assert b["labels"] == labels and close_scores(b["scores"], scores), b
    # the inputs in the other order; one row
    body = {"inputs": {"category": CAT[:1].tolist(), "numeric": NUM[:1].tolist()}}
    b = ok_json(post(server, "/models/tab/predict", body), "columnar reversed")
    assert_outputs(columns_answer(b, TAB_NAMES, "columnar reversed"), tab(NUM[:1], CAT[:1]),
                   "columnar reversed")


@pytest.mark.parametrize("compressed", [False, True], ids=["savez", "savez_compressed"])
def test_npz_body(server, compressed):
    deployed(server, "tab", "tabular", TAB_CONFIG)
    want = tab(NUM, CAT)
    r = post_npz(server, "/models/tab/predict", compressed, numeric=NUM, category=CAT)
    b = ok_json(r, "NPZ")
    assert_outputs(any_answer(b, TAB_NAMES, len(CAT), "NPZ"), want, "NPZ")
    # the arrays in the other order in the archive
    r = post_npz(server, "/models/tab/predict", compressed, category=CAT[1:3], numeric=NUM[1:3])
    b = ok_json(r, "NPZ reversed")
    assert_outputs(any_answer(b, TAB_NAMES, 2, "NPZ reversed"), tab(NUM[1:3], CAT[1:3]),
                   "NPZ reversed")


def test_kserve_v1_objects(server):
    deployed(server, "tab", "tabular", TAB_CONFIG)
    r = post(server, "/v1/models/tab:predict", {"instances": objects(NUM, CAT)})
    b = ok_json(r, "V1")
    assert list(b) == ["predictions"], b
    assert_outputs(rows_answer(b, TAB_NAMES, len(CAT), "V1"), tab(NUM, CAT), "V1")
    # a model with one output answers plain rows
    deployed(server, "one", "tabular_one", {"inputs": TAB_INPUTS})
    b = ok_json(post(server, "/v1/models/one:predict", {"instances": objects(NUM, CAT)}), "V1 one")
    assert list(b) == ["predictions"], b
    assert_close(b["predictions"], tab(NUM, CAT)["logits"], "V1 one output")


@pytest.mark.parametrize("order", [("numeric", "category"), ("category", "numeric")])
def test_v2_json_inputs_in_any_order(server, order):
    deployed(server, "tab", "tabular", TAB_CONFIG)
    want = tab(NUM, CAT)
    body, headers = tab_v2(NUM, CAT, order=order, id="r-9")
    r = post(server, "/v2/models/tab/infer", body, headers=headers)
    head, got = v2_outputs(r, f"V2 JSON {order}")
    assert head["model_name"] == "tab" and head["model_version"] == "1" and head["id"] == "r-9", head
    assert [name for name, _ in got] == TAB_NAMES, head
    assert_outputs(dict(got), want, f"V2 JSON {order}")
    assert "labels" not in head, "V2 answers the raw outputs"
    # the version route
    r = post(server, "/v2/models/tab/versions/1/infer", body, headers=headers)
    assert_outputs(dict(v2_outputs(r, "V2 versions/1")[1]), want, "V2 versions/1")


@pytest.mark.parametrize("binary,order", [
    (("numeric", "category"), ("category", "numeric")),
    (("numeric", "category"), ("numeric", "category")),
    (("numeric",), ("category", "numeric")),   # mixed: one binary, one JSON
    (("category",), ("numeric", "category")),
])
def test_v2_binary_inputs(server, binary, order):
    deployed(server, "tab", "tabular", TAB_CONFIG)
    want = tab(NUM, CAT)
    what = f"V2 binary {binary} order {order}"
    body, headers = tab_v2(NUM, CAT, order=order, binary=binary)
    head, got = v2_outputs(post(server, "/v2/models/tab/infer", body, headers=headers), what)
    assert [name for name, _ in got] == TAB_NAMES, head
    assert_outputs(dict(got), want, what)
    # binary outputs too: every output's bytes, in the header's order
    body, headers = tab_v2(NUM, CAT, order=order, binary=binary, binary_outputs=True)
    r = post(server, "/v2/models/tab/infer", body, headers=headers)
    assert "Inference-Header-Content-Length" in r.headers, f"{what}: no binary outputs: {r.text!r}"
    head, got = v2_outputs(r, what + ", binary outputs")
    assert sorted(name for name, _ in got) == sorted(TAB_NAMES), head
    assert_outputs(dict(got), want, what + ", binary outputs")


def test_v2_output_selection(server):
    deployed(server, "tab", "tabular", TAB_CONFIG)
    want = tab(NUM, CAT)
    for outs in (["embedding"], ["logits"], ["embedding", "logits"]):
        for binary_out in (False, True):
            what = f"V2 outputs {outs} binary={binary_out}"
            body, headers = tab_v2(NUM, CAT, outputs=outs, binary_outputs=binary_out)
            head, got = v2_outputs(post(server, "/v2/models/tab/infer", body, headers=headers), what)
            assert sorted(name for name, _ in got) == sorted(outs), f"{what}: {head}"
            assert_outputs(dict(got), {k: want[k] for k in outs}, what)
    body, headers = tab_v2(NUM, CAT, outputs=["nope"])
    v2_error(post(server, "/v2/models/tab/infer", body, headers=headers), 400, "nope")
    body, headers = tab_v2(NUM, CAT, outputs=["logits", "logits"])
    v2_error(post(server, "/v2/models/tab/infer", body, headers=headers), 400, "logits")


def test_labels_and_top_k_read_the_logits_output(server):
    deployed(server, "tab", "tabular", TAB_CONFIG)
    want = tab(NUM, CAT)
    for k in (1, 2, 3, 10):
        labels, scores = top(want["logits"], min(k, 3))
        for form, body, answer in (("rows", objects(NUM, CAT), rows_answer),
                                   ("columnar", columns(NUM, CAT), None)):
            what = f"top_k={k} {form}"
            b = ok_json(post(server, f"/models/tab/predict?top_k={k}", body), what)
            assert b["labels"] == labels, f"{what}: {b['labels']} != {labels}"
            assert close_scores(b["scores"], scores), what
    # the only output is the one labels read
    deployed(server, "one", "tabular_one", {"inputs": TAB_INPUTS, "output": "logits",
                                            "labels": LABELS})
    labels, scores = top(want["logits"], 2)
    b = ok_json(post(server, "/models/one/predict?top_k=2", objects(NUM, CAT)), "one output")
    assert_close(b["predictions"], want["logits"], "one output, rows as objects")
    assert b["labels"] == labels and close_scores(b["scores"], scores), b
    # V2 with one output
    body, headers = tab_v2(NUM, CAT, order=("category", "numeric"), binary=("category",))
    head, got = v2_outputs(post(server, "/v2/models/one/infer", body, headers=headers), "V2 one")
    assert len(got) == 1, head
    assert_close(got[0][1], want["logits"], "V2 one output")
    # columnar with one output: {"outputs": [[..], ..]} (spec)
    b = ok_json(post(server, "/models/one/predict", columns(NUM, CAT)), "one output, columnar")
    assert "outputs" in b, f"a columnar request is answered with \"outputs\": {b}"
    assert_close(b["outputs"], want["logits"], "one output, columnar")
    assert b["labels"] == top(want["logits"], 1)[0], b


def test_preprocess_per_input(server):
    """(x * scale - mean) / std on the input that declares it, not the other.
    One mean/std for a feature vector (per channel needs (C, H, W), as the
    single-input preprocess; per channel is tested on seqmask's seq)."""
    mean, std, scale = [0.5], [2.0], 0.5
    cfg = {"inputs": [{"name": "numeric", "shape": [4],
                       "preprocess": {"mean": mean, "std": std, "scale": scale}},
                      {"name": "category", "shape": [], "dtype": "int64"}],
           "outputs": TAB_OUTPUTS}
    deployed(server, "pre", "tabular", cfg)
    x = (NUM * np.float32(scale) - np.float32(0.5)) / np.float32(2.0)
    want = tab(x.astype(np.float32), CAT)
    b = ok_json(post(server, "/models/pre/predict", objects(NUM, CAT)), "preprocess rows")
    assert_outputs(rows_answer(b, TAB_NAMES, len(CAT), "preprocess"), want, "preprocess rows")
    body, headers = tab_v2(NUM, CAT, binary=("numeric", "category"))
    head, got = v2_outputs(post(server, "/v2/models/pre/infer", body, headers=headers), "V2 pre")
    assert_outputs(dict(got), want, "preprocess V2")
    # per channel: seq [3, 2] has 3 channels
    mean3, std3 = [0.25, -1.0, 0.5], [0.5, 2.0, 4.0]
    cfg = {**SEQ_CONFIG, "inputs": [{"name": "seq", "shape": [3, 2], "dtype": "float32",
                                     "preprocess": {"mean": mean3, "std": std3}},
                                    SEQ_CONFIG["inputs"][1]]}
    deployed(server, "seqpre", "seqmask", cfg)
    seq, mask = SEQ, MASK
    x = (seq - np.array(mean3, np.float32)[:, None]) / np.array(std3, np.float32)[:, None]
    want = oracle("seqmask", x.astype(np.float32), mask)
    rows = [{"seq": a.tolist(), "mask": m.tolist()} for a, m in zip(seq, mask)]
    b = ok_json(post(server, "/models/seqpre/predict", rows), "per-channel preprocess")
    assert_outputs(rows_answer(b, ["pooled", "count"], len(seq), "per channel"), want,
                   "per-channel preprocess")


def test_tuple_output_one_input(server):
    """outputs without inputs: one tensor input in every old form, a tuple answered by name."""
    names = ["logits", "norm"]
    deployed(server, "tup", "tuple", {"input": {"shape": [4]},
                                      "outputs": [{"name": "logits", "shape": [3]},
                                                  {"name": "norm", "shape": [1]}]})
    want = oracle("tuple", NUM, names=names)
    n = len(NUM)
    for form, body in (("rows", NUM.tolist()), ("instances", {"instances": NUM.tolist()}),
                       ("array", {"array": NUM.tolist()})):
        b = ok_json(post(server, "/models/tup/predict", body), form)
        assert_outputs(rows_answer(b, names, n, form), want, f"tuple, {form}")
    buf = io.BytesIO()
    np.save(buf, NUM)
    b = ok_json(post(server, "/models/tup/predict", buf.getvalue(),
                     headers={"Content-Type": "application/x-npy"}), "NPY")
    assert_outputs(any_answer(b, names, n, "NPY"), want, "tuple, NPY")
    b = ok_json(post(server, "/v1/models/tup:predict", {"instances": NUM.tolist()}), "V1")
    assert_outputs(rows_answer(b, names, n, "V1"), want, "tuple, V1")
    for binary in (False, True):
        body, headers = v2_body([v2_input("input0", NUM, "FP32", binary)])
        head, got = v2_outputs(post(server, "/v2/models/tup/infer", body, headers=headers), "V2")
        assert [k for k, _ in got] == names, head
        assert_outputs(dict(got), want, f"tuple, V2 binary={binary}")


def test_dict_output_matched_by_key(server):
    """A dict result is matched by key, whatever the declared order: probs
    and logits differ, so a positional mapping shows."""
    deployed(server, "dct", "dict", {"input": {"shape": [4]}, "labels": LABELS,
                                     "outputs": [{"name": "probs", "shape": [3]},
                                                 {"name": "logits", "logits": True, "shape": [3]}]})
    want = oracle("dict", NUM)
    assert set(want) == {"logits", "probs"}
    b = ok_json(post(server, "/models/dct/predict?top_k=2", NUM.tolist()), "dict rows")
    assert_outputs(rows_answer(b, ["probs", "logits"], len(NUM), "dict"), want, "dict rows")
    labels, scores = top(want["logits"], 2)
    assert b["labels"] == labels and close_scores(b["scores"], scores), b
    body, headers = v2_body([v2_input("x", NUM, "FP32", True)], binary_outputs=True)
    head, got = v2_outputs(post(server, "/v2/models/dct/infer", body, headers=headers), "V2")
    assert [k for k, _ in got] == ["probs", "logits"], head
    assert_outputs(dict(got), want, "dict, V2")
    body, headers = v2_body([v2_input("x", NUM, "FP32")], outputs=["probs"])
    head, got = v2_outputs(post(server, "/v2/models/dct/infer", body, headers=headers), "V2 sel")
    assert [k for k, _ in got] == ["probs"], head
    assert_close(got[0][1], want["probs"], "dict, V2 probs only")


def test_bool_input_and_scalar_output(server):
    """A sequence and its bool mask; a dict with a scalar per row."""
    deployed(server, "seq", "seqmask", SEQ_CONFIG)
    seq, mask = SEQ, MASK
    want = oracle("seqmask", seq, mask)
    names = ["pooled", "count"]
    rows = [{"seq": s.tolist(), "mask": m.tolist()} for s, m in zip(seq, mask)]
    b = ok_json(post(server, "/models/seq/predict", rows), "rows")
    got = rows_answer(b, names, 5, "rows")
    assert got["count"].shape == (5,), f"a scalar output is one number per row: {b}"
    assert_outputs(got, want, "seqmask rows")
    b = ok_json(post(server, "/models/seq/predict",
                     {"inputs": {"seq": seq.tolist(), "mask": mask.tolist()}}), "columnar")
    assert_outputs(columns_answer(b, names, "columnar"), want, "seqmask columnar")
    for binary in (False, True):
        body, headers = v2_body([v2_input("mask", mask, "BOOL", binary),
                                 v2_input("seq", seq, "FP32", binary)])
        head, got = v2_outputs(post(server, "/v2/models/seq/infer", body, headers=headers), "V2")
        shapes = {k: list(a.shape) for k, a in got}
        assert shapes == {"pooled": [5, 2], "count": [5]}, head
        assert_outputs(dict(got), want, f"seqmask V2 binary={binary}")
    b = ok_json(post_npz(server, "/models/seq/predict", seq=seq, mask=mask), "NPZ")
    assert_outputs(any_answer(b, names, 5, "NPZ"), want, "seqmask NPZ")


def test_integer_output_is_answered_as_float32(server):
    """A tuple with an int64 output (class ids): declared dtype int64, answered
    as float32 numbers (FP32 in V2) like every output."""
    names = ["logits", "class"]
    deployed(server, "am", "argmax", {"input": {"shape": [4]},
                                      "outputs": [{"name": "logits", "shape": [3]},
                                                  {"name": "class", "shape": [], "dtype": "int64"}]})
    want = oracle("argmax", NUM, names=names)
    b = ok_json(post(server, "/models/am/predict", NUM.tolist()), "rows")
    got = rows_answer(b, names, len(NUM), "rows")
    assert got["class"].shape == (len(NUM),), b
    assert_outputs(got, want, "integer output, rows")
    body, headers = v2_body([v2_input("x", NUM, "FP32", True)], binary_outputs=True)
    head, got = v2_outputs(post(server, "/v2/models/am/infer", body, headers=headers), "V2")
    assert [(k, list(a.shape)) for k, a in got] == [("logits", [6, 3]), ("class", [6])], head
    assert_outputs(dict(got), want, "integer output, V2")
    # declared float32, it is refused at deploy, naming it
    r = deploy(server, "am2", "argmax", {"input": {"shape": [4]},
                                         "outputs": [{"name": "logits"},
                                                     {"name": "class", "dtype": "float32"}]})
    error(r, 422, MISMATCH, "class")


SEQ_CONFIG = {"inputs": [{"name": "seq", "shape": [3, 2], "dtype": "float32"},
                         {"name": "mask", "shape": [3], "dtype": "bool"}],
              "outputs": [{"name": "pooled", "shape": [2]}, {"name": "count", "shape": []}]}
SEQ = (np.random.default_rng(3).integers(-64, 64, size=(5, 3, 2)) / 16.0).astype(np.float32)
MASK = np.array([[1, 1, 0], [0, 0, 0], [1, 0, 1], [0, 1, 0], [1, 1, 1]], dtype=np.bool_)

IDS = np.array([BIG, -BIG, 2 ** 63 - 1, -2 ** 63, 5, 1999, 2 ** 53], dtype=np.int64)


def test_int64_inputs_are_exact(server):
    """2**53 + 1 through a double is 2**53: (id % 1000, id == 2**53 + 1) show it."""
    deployed(server, "ids", "ids", {"inputs": [{"name": "ids", "shape": [], "dtype": "int64"}]})
    want = oracle("ids", IDS)
    assert want[0].tolist() == [993.0, 1.0] and want[6].tolist() == [992.0, 0.0], want
    ids = [int(v) for v in IDS]
    forms = [
        ("plain rows (one declared input)", "json", ids),
        ("rows as objects", "json", [{"ids": v} for v in ids]),
        ("instances", "json", {"instances": [{"ids": v} for v in ids]}),
        ("columnar", "json", {"inputs": {"ids": ids}}),
    ]
    for what, _, body in forms:
        b = ok_json(post(server, "/models/ids/predict", body), what)
        got = b["outputs"] if "outputs" in b else b["predictions"]
        assert_close(got, want, what)
    b = ok_json(post(server, "/v1/models/ids:predict", {"instances": [{"ids": v} for v in ids]}),
                "V1")
    assert_close(b["predictions"], want, "V1")
    for binary in (False, True):
        body, headers = v2_body([v2_input("ids", IDS, "INT64", binary)])
        head, got = v2_outputs(post(server, "/v2/models/ids/infer", body, headers=headers), "V2")
        assert_close(got[0][1], want, f"V2 INT64 binary={binary}")
    # what is not an int64 is refused, naming the input
    for bad in ("1.5", "1e3", "5.0", '"5"', "9223372036854775808", "-9223372036854775809",
                "null"):
        r = post(server, "/models/ids/predict", '[{"ids": %s}]' % bad)
        error(r, 400, BAD, "ids")
        r = post(server, "/models/ids/predict", '{"inputs": {"ids": [1, %s]}}' % bad)
        error(r, 400, BAD, "ids")


@pytest.mark.parametrize("dtype,datatype,values,bad", [
    ("int32", "INT32", [5, 1999, -7, 2 ** 31 - 1, -2 ** 31], ["2147483648", "-2147483649", "1.5"]),
    ("uint8", "UINT8", [0, 5, 255, 17], ["256", "-1", "2.5"]),
    ("float64", "FP64", [0.5, -3.25, 1e10, 1999.75], ['"x"']),
])
def test_other_input_dtypes(server, dtype, datatype, values, bad):
    """The ids model (remainder and ==, any numeric type) declared int32,
    uint8 or float64: values in range are exact, others 400 naming the input."""
    np_type = {"int32": np.int32, "uint8": np.uint8, "float64": np.float64}[dtype]
    deployed(server, "ids", "ids", {"inputs": [{"name": "ids", "shape": [], "dtype": dtype}]})
    arr = np.array(values, dtype=np_type)
    want = oracle("ids", arr)
    b = ok_json(post(server, "/models/ids/predict", [{"ids": v} for v in values]), "rows")
    assert_close(b["predictions"], want, f"{dtype} rows as objects")
    b = ok_json(post(server, "/models/ids/predict", {"inputs": {"ids": values}}), "columnar")
    assert_close(b["outputs"] if "outputs" in b else b["predictions"], want, f"{dtype} columnar")
    m = ok_json(server.get("/v2/models/ids"), "metadata")
    assert m["inputs"] == [{"name": "ids", "datatype": datatype, "shape": [-1]}], m
    for binary in (False, True):
        body, headers = v2_body([v2_input("ids", arr, datatype, binary)])
        head, got = v2_outputs(post(server, "/v2/models/ids/infer", body, headers=headers), "V2")
        assert_close(got[0][1], want, f"{dtype} V2 binary={binary}")
    for v in bad:
        error(post(server, "/models/ids/predict", '[{"ids": %s}]' % v), 400, BAD, "ids")
    b = ok_json(post_npz(server, "/models/ids/predict", ids=arr), "NPZ")
    assert_close(b["outputs"] if "outputs" in b else b["predictions"], want, f"{dtype} NPZ")


def test_int64_npz_and_npy_bodies_are_exact(server):
    """An int64 array in an NPZ body, and in an NPY body for the one-input
    model ("a single-input model keeps every old form"), is read exactly."""
    deployed(server, "ids", "ids", {"inputs": [{"name": "ids", "shape": [], "dtype": "int64"}]})
    want = oracle("ids", IDS)
    b = ok_json(post_npz(server, "/models/ids/predict", ids=IDS), "NPZ")
    assert_close(b["outputs"] if "outputs" in b else b["predictions"], want, "NPZ")
    buf = io.BytesIO()
    np.save(buf, IDS)
    b = ok_json(post(server, "/models/ids/predict", buf.getvalue(),
                     headers={"Content-Type": "application/x-npy"}), "NPY int64")
    assert_close(b["predictions"], want, "NPY int64")


# ---------------------------------------------------------------- the old forms


def test_single_input_model_keeps_every_old_form(server):
    deployed(server, "mlp", "mlp", {"input": {"shape": [4]}, "output": "logits"})
    want = oracle("mlp", NUM)
    n = len(NUM)
    for what, body in (("rows", NUM.tolist()), ("instances", {"instances": NUM.tolist()}),
                       ("array", {"array": NUM.flatten().tolist(), "shape": [n, 4]}),
                       ("one row", NUM[0].tolist())):
        b = ok_json(post(server, "/models/mlp/predict", body), what)
        assert_close(b["predictions"], want if what != "one row" else want[:1], what)
        assert "outputs" not in b, b
    buf = io.BytesIO()
    np.save(buf, NUM)
    b = ok_json(post(server, "/models/mlp/predict", buf.getvalue(),
                     headers={"Content-Type": "application/x-npy"}), "NPY")
    assert_close(b["predictions"], want, "NPY")
    b = ok_json(post(server, "/v1/models/mlp:predict", {"instances": NUM.tolist()}), "V1")
    assert_close(b["predictions"], want, "V1")
    body, headers = v2_body([v2_input("input0", NUM, "FP32", True)])
    head, got = v2_outputs(post(server, "/v2/models/mlp/infer", body, headers=headers), "V2")
    assert len(got) == 1
    assert_close(got[0][1], want, "V2")


def test_one_declared_input_takes_rows_objects_and_plain_rows(server):
    deployed(server, "mlpx", "mlp", {"inputs": [{"name": "x", "shape": [4]}]})
    want = oracle("mlp", NUM)
    for what, body in (("plain rows", NUM.tolist()),
                       ("rows as objects", [{"x": r} for r in NUM.tolist()]),
                       ("instances objects", {"instances": [{"x": r} for r in NUM.tolist()]})):
        b = ok_json(post(server, "/models/mlpx/predict", body), what)
        assert_close(b["predictions"], want, what)
    body, headers = v2_body([v2_input("x", NUM, "FP32", True)])
    head, got = v2_outputs(post(server, "/v2/models/mlpx/infer", body, headers=headers), "V2")
    assert_close(got[0][1], want, "V2")
    error(post(server, "/models/mlpx/predict", [{"y": NUM[0].tolist()}]), 400, BAD_KEY, "y")
    # columnar, one output: "outputs" is the rows (spec)
    b = ok_json(post(server, "/models/mlpx/predict", {"inputs": {"x": NUM.tolist()}}), "columnar")
    assert_close(b["outputs"], want, "columnar")
    b = ok_json(post_npz(server, "/models/mlpx/predict", x=NUM), "NPZ")
    assert_close(b["outputs"] if "outputs" in b else b["predictions"], want, "NPZ")


# ---------------------------------------------------------------- batching


def send_form(srv, form, numeric, category):
    """One request of the tabular model in `form`: its outputs as name -> array."""
    n = len(category)
    if form == "rows":
        b = ok_json(post(srv, "/models/tab/predict", objects(numeric, category)), form)
        return rows_answer(b, TAB_NAMES, n, form)
    if form == "instances":
        b = ok_json(post(srv, "/models/tab/predict", {"instances": objects(numeric, category)}),
                    form)
        return rows_answer(b, TAB_NAMES, n, form)
    if form == "columnar":
        return columns_answer(ok_json(post(srv, "/models/tab/predict", columns(numeric, category)),
                                      form), TAB_NAMES, form)
    if form == "npz":
        b = ok_json(post_npz(srv, "/models/tab/predict", numeric=numeric, category=category), form)
        return any_answer(b, TAB_NAMES, n, form)
    if form == "v1":
        b = ok_json(post(srv, "/v1/models/tab:predict", {"instances": objects(numeric, category)}),
                    form)
        return rows_answer(b, TAB_NAMES, n, form)
    if form in ("v2json", "v2binary", "v2mixed"):
        binary = {"v2json": (), "v2binary": ("numeric", "category"), "v2mixed": ("category",)}[form]
        body, headers = tab_v2(numeric, category, order=("category", "numeric"), binary=binary)
        return dict(v2_outputs(post(srv, "/v2/models/tab/infer", body, headers=headers), form)[1])
    raise AssertionError(form)


FORMS = ["rows", "instances", "columnar", "npz", "v1", "v2json", "v2binary", "v2mixed"]


def test_mixed_forms_share_one_batch(server):
    """Deterministic: one worker that waits (max_delay_us, 10 s) until the
    batch holds max_batch_size rows; 4 requests of 2 rows in 4 forms sent
    together fill it exactly, so they are one forward of 8 rows, whatever
    the machine's speed, and each gets its own rows back."""
    deployed(server, "tab", "tabular", {**TAB_CONFIG, "workers": 1, "batching": {
        "max_batch_size": 8, "max_delay_us": 10000000, "timeout_ms": 120000}})
    numeric, category = rng_rows(1, 8)
    forms = ["rows", "columnar", "v1", "v2binary"]  # NPZ: in the load test
    start = threading.Barrier(len(forms))

    def one(i):
        start.wait()
        sl = slice(2 * i, 2 * i + 2)
        return send_form(server, forms[i], numeric[sl], category[sl])

    with ThreadPoolExecutor(len(forms)) as ex:
        got = list(ex.map(one, range(len(forms))))
    for i, g in enumerate(got):
        sl = slice(2 * i, 2 * i + 2)
        assert_outputs(g, tab(numeric[sl], category[sl]), f"{forms[i]} in the shared batch")
    st = loaded_stats(server, "tab")
    assert st["requests"] == 4 and st["rows"] == 8, st
    assert st["batches"] == 1, f"the 4 requests were not one forward: {st}"


def test_v2_requests_of_every_kind_share_one_batch(server):
    """The same, with V2 requests that differ in what they ask back: JSON or
    binary inputs, inputs in either order, one output or both, JSON or binary
    outputs. Each gets exactly its own rows of the outputs it asked for."""
    deployed(server, "tab", "tabular", {**TAB_CONFIG, "workers": 1, "batching": {
        "max_batch_size": 9, "max_delay_us": 10000000, "timeout_ms": 120000}})
    numeric, category = rng_rows(1, 9)
    kinds = [  # (rows, tab_v2 arguments)
        (slice(0, 1), dict(order=("category", "numeric"), outputs=["embedding"])),
        (slice(1, 4), dict(binary=("numeric", "category"), binary_outputs=True)),
        (slice(4, 6), dict(binary=("category",), outputs=["logits"], binary_outputs=True)),
        (slice(6, 9), dict(order=("category", "numeric"), outputs=["embedding", "logits"])),
    ]
    start = threading.Barrier(len(kinds))

    def one(k):
        sl, kw = kinds[k]
        body, headers = tab_v2(numeric[sl], category[sl], **kw)
        start.wait()
        r = post(server, "/v2/models/tab/infer", body, headers=headers)
        return dict(v2_outputs(r, f"V2 kind {k}")[1])

    with ThreadPoolExecutor(len(kinds)) as ex:
        got = list(ex.map(one, range(len(kinds))))
    for k, (sl, kw) in enumerate(kinds):
        want = tab(numeric[sl], category[sl])
        names = kw.get("outputs", TAB_NAMES)
        assert_outputs(got[k], {n: want[n] for n in names}, f"V2 kind {k} in the shared batch")
    st = loaded_stats(server, "tab")
    assert st["requests"] == 4 and st["rows"] == 9 and st["batches"] == 1, st


def test_request_split_past_max_batch_size(server):
    """A request of more rows than max_batch_size is computed in pieces (by
    two workers); every output comes back whole, in row order."""
    deployed(server, "tab", "tabular", {**TAB_CONFIG, "workers": 2,
                                        "batching": {"max_batch_size": 4}})
    numeric, category = rng_rows(1, 11)
    want = tab(numeric, category)
    for form in ("rows", "columnar", "v1", "v2binary", "v2json"):
        assert_outputs(send_form(server, form, numeric, category), want, f"11 rows, {form}")
    st = loaded_stats(server, "tab")
    assert st["rows"] == 55 and st["batches"] >= 5 * 3, st  # 11 rows take 3 forwards of <= 4


def test_mixed_requests_under_load(server):
    """8 threads, 25 requests each, of every form and 1..6 rows: every
    answer is PyTorch's for its own rows, and the version counted them all."""
    deployed(server, "tab", "tabular", {**TAB_CONFIG, "workers": 2})
    pool_num, pool_cat = rng_rows(1, 40)
    want = tab(pool_num, pool_cat)
    sent = []
    lock = threading.Lock()

    def worker(t):
        g = np.random.default_rng(100 + t)
        rows = 0
        for k in range(25):
            form = FORMS[(t + k) % len(FORMS)]
            n = int(g.integers(1, 7))
            idx = g.choice(40, size=n, replace=False)
            got = send_form(server, form, pool_num[idx], pool_cat[idx])
            assert_outputs(got, {k2: v[idx] for k2, v in want.items()},
                           f"thread {t} request {k} ({form}, {n} rows)")
            rows += n
        with lock:
            sent.append(rows)

    with ThreadPoolExecutor(8) as ex:
        for f in [ex.submit(worker, t) for t in range(8)]:
            f.result()
    st = loaded_stats(server, "tab")
    assert st["requests"] == 200 and st["rows"] == sum(sent), (st, sum(sent))
    assert 1 <= st["batches"] <= 200 and sum(st["batch_size_histogram"]) == st["batches"], st


def test_declared_io_survives_a_restart(start_server, tmp_path):
    """The declarations are part of the stored version: after a restart on the
    same store the model still takes its named inputs and answers every output."""
    store = tmp_path / "store-restart"
    srv = start_server(store=store)
    deployed(srv, "tab", "tabular", TAB_CONFIG)
    srv.stop()
    srv = start_server(store=store)
    want = tab(NUM, CAT)
    b = ok_json(post(srv, "/models/tab/predict", objects(NUM, CAT)), "after restart")
    assert_outputs(rows_answer(b, TAB_NAMES, len(CAT), "after restart"), want, "after restart")
    assert b["labels"] == top(want["logits"], 1)[0], b
    body, headers = tab_v2(NUM, CAT, binary=("category",))
    head, got = v2_outputs(post(srv, "/v2/models/tab/infer", body, headers=headers), "V2")
    assert_outputs(dict(got), want, "V2 after restart")
    m = ok_json(srv.get("/v2/models/tab"), "metadata after restart")
    assert [i["name"] for i in m["inputs"]] == ["numeric", "category"], m


# ---------------------------------------------------------------- deploy 422s


DEPLOY_REFUSALS = [
    # (id, fixture, config, codes, words)
    ("tuple-missing-output", "tuple",
     {"input": {"shape": [4]}, "outputs": [{"name": "logits"}, {"name": "norm"}, {"name": "extra"}]},
     MISMATCH, ["extra"]),
    ("dict-missing-key", "dict",
     {"input": {"shape": [4]}, "outputs": [{"name": "logits"}, {"name": "scores"}]},
     MISMATCH, ["scores"]),
    ("output-shape", "tabular",
     {"inputs": TAB_INPUTS, "outputs": [{"name": "logits", "shape": [3]},
                                        {"name": "embedding", "shape": [9]}]},
     MISMATCH, ["embedding"]),
    ("output-shape-rank", "tabular",
     {"inputs": TAB_INPUTS, "outputs": [{"name": "logits", "shape": [3, 1]},
                                        {"name": "embedding"}]},
     MISMATCH, ["logits"]),
    ("tuple-order-swapped", "tabular",
     {"inputs": TAB_INPUTS, "outputs": [{"name": "embedding", "shape": [8]},
                                        {"name": "logits", "shape": [3]}]},
     MISMATCH, ["embedding"]),
    ("output-dtype", "tabular",
     {"inputs": TAB_INPUTS, "outputs": [{"name": "logits"},
                                        {"name": "embedding", "dtype": "int64"}]},
     MISMATCH, ["embedding"]),
    ("input-shape", "tabular",
     {"inputs": [{"name": "numeric", "shape": [5]}, TAB_INPUTS[1]], "outputs": TAB_OUTPUTS},
     FORWARD_FAILS, []),
    ("input-dtype", "tabular",
     {"inputs": [TAB_INPUTS[0], {"name": "category", "shape": [], "dtype": "float32"}],
      "outputs": TAB_OUTPUTS},
     FORWARD_FAILS, []),
    ("too-few-inputs", "tabular",
     {"inputs": [TAB_INPUTS[0]], "outputs": TAB_OUTPUTS}, FORWARD_FAILS, []),
    ("too-many-inputs", "tabular",
     {"inputs": TAB_INPUTS + [{"name": "extra", "shape": [1]}], "outputs": TAB_OUTPUTS},
     FORWARD_FAILS, []),
    ("name-space", "tabular",
     {"inputs": [{"name": "num eric", "shape": [4]}, TAB_INPUTS[1]]}, {"invalid_config"},
     ["num eric"]),
    ("name-empty", "tabular",
     {"inputs": [{"name": "", "shape": [4]}, TAB_INPUTS[1]]}, {"invalid_config"}, ["inputs"]),
    ("name-64-chars", "tabular",
     {"inputs": [{"name": "n" * 64, "shape": [4]}, TAB_INPUTS[1]]}, {"invalid_config"},
     ["inputs"]),
    ("name-non-ascii", "tabular",
     {"inputs": [{"name": "numéric", "shape": [4]}, TAB_INPUTS[1]]}, {"invalid_config"},
     ["inputs"]),
    ("name-slash", "tuple",
     {"input": {"shape": [4]}, "outputs": [{"name": "lo/gits"}, {"name": "norm"}]},
     {"invalid_config"}, ["lo/gits"]),
    ("name-not-string", "tabular",
     {"inputs": [{"name": 7, "shape": [4]}, TAB_INPUTS[1]]}, {"invalid_config"}, ["inputs"]),
    ("duplicate-input", "tabular",
     {"inputs": [{"name": "numeric", "shape": [4]}, {"name": "numeric", "shape": [],
                                                      "dtype": "int64"}]},
     {"invalid_config"}, ["numeric"]),
    ("duplicate-output", "tuple",
     {"input": {"shape": [4]}, "outputs": [{"name": "logits"}, {"name": "logits"}]},
     {"invalid_config"}, ["logits"]),
    ("output-name-of-a-job-field", "tuple",
     {"input": {"shape": [4]}, "outputs": [{"name": "prediction"}, {"name": "norm"}]},
     {"invalid_config"}, ["prediction"]),
    ("input-and-inputs", "tabular",
     {"input": {"shape": [4]}, "inputs": TAB_INPUTS}, {"invalid_config"}, ["input"]),
    ("two-logits", "tabular",
     {"inputs": TAB_INPUTS, "outputs": [{"name": "logits", "logits": True},
                                        {"name": "embedding", "logits": True}]},
     {"invalid_config"}, ["logits"]),
    ("dtype-unknown", "tabular",
     {"inputs": [{"name": "numeric", "shape": [4], "dtype": "float16"}, TAB_INPUTS[1]]},
     {"invalid_config"}, ["numeric"]),
    ("shape-8-dims", "tabular",
     {"inputs": [{"name": "numeric", "shape": [1] * 8}, TAB_INPUTS[1]]},
     {"invalid_config"}, ["numeric"]),
    ("shape-zero-dim", "tabular",
     {"inputs": [{"name": "numeric", "shape": [4, 0]}, TAB_INPUTS[1]]},
     {"invalid_config"}, ["numeric"]),
    ("inputs-empty", "tabular", {"inputs": []}, {"invalid_config"}, ["inputs"]),
    ("inputs-not-list", "tabular", {"inputs": {"numeric": [4]}}, {"invalid_config"}, ["inputs"]),
]


@pytest.mark.parametrize("fixture,config,codes,words",
                         [c[1:] for c in DEPLOY_REFUSALS], ids=[c[0] for c in DEPLOY_REFUSALS])
def test_deploy_refuses(server, fixture, config, codes, words):
    r = deploy(server, "bad", fixture, config)
    error(r, 422, codes, *words)
    assert server.get("/models/bad").status_code == 404, "a refused deploy left a model"


def test_deploy_accepts_names_at_the_limits(server):
    """63 characters of every allowed kind; outputs may be fewer than the tuple's."""
    long = ("Ab9_.-" * 11)[:63]
    cfg = {"inputs": [{"name": long, "shape": [4]},
                      {"name": "c.a-t_9", "shape": [], "dtype": "int64"}],
           "outputs": [{"name": "L", "shape": [3]}, {"name": "E-1.x", "shape": [8]}]}
    deployed(server, "limits", "tabular", cfg)
    b = ok_json(post(server, "/models/limits/predict",
                     {"inputs": {long: NUM.tolist(), "c.a-t_9": CAT.tolist()}}), "long names")
    want = tab(NUM, CAT)
    assert_outputs(columns_answer(b, ["L", "E-1.x"], "long names"),
                   {"L": want["logits"], "E-1.x": want["embedding"]}, "long names")


# ---------------------------------------------------------------- request 400s


REQUEST_ERRORS = [
    # (id, kind, body, codes, words)   kind: json | npz | v2 | v1
    ("rows-missing-input", "json", [{"numeric": [1, 2, 3, 4]}], BAD, ["category"]),
    ("rows-second-row-missing-key", "json",
     [{"numeric": [1, 2, 3, 4], "category": 1}, {"numeric": [1, 2, 3, 4]}], BAD,
     ["category", "row 1"]),
    ("rows-extra-input", "json", [{"numeric": [1, 2, 3, 4], "category": 1, "colour": 2}], BAD_KEY,
     ["colour"]),
    ("rows-float-for-int64", "json", [{"numeric": [1, 2, 3, 4], "category": 3.5}], BAD,
     ["category"]),
    ("rows-exponent-for-int64", "json", '[{"numeric": [1, 2, 3, 4], "category": 3e0}]', BAD,
     ["category"]),
    ("rows-string-for-int64", "json", [{"numeric": [1, 2, 3, 4], "category": "3"}], BAD,
     ["category"]),
    ("rows-int64-overflow", "json",
     '[{"numeric": [1, 2, 3, 4], "category": 9223372036854775808}]', BAD, ["category"]),
    ("rows-short-numeric", "json", [{"numeric": [1, 2, 3], "category": 1}], BAD_SHAPE,
     ["numeric"]),
    ("rows-nested-numeric", "json", [{"numeric": [[1, 2], [3, 4]], "category": 1}], BAD_SHAPE,
     ["numeric"]),
    ("rows-list-for-scalar", "json", [{"numeric": [1, 2, 3, 4], "category": [1]}], BAD_SHAPE,
     ["category"]),
    ("rows-string-in-numeric", "json", [{"numeric": [1, "x", 3, 4], "category": 1}], BAD,
     ["numeric"]),
    ("rows-duplicate-key", "json", '[{"numeric": [1, 2, 3, 4], "category": 1, "category": 2}]',
     BAD, ["category"]),
    ("rows-empty", "json", [], BAD, []),
    ("ray-serve-array-is-single-input", "json", {"array": [[1, 2, 3, 4]]}, BAD_KEY, ["array"]),
    ("instances-missing-input", "json", {"instances": [{"numeric": [1, 2, 3, 4]}]}, BAD,
     ["category"]),
    ("rows-array-not-object", "json", [[1, 2, 3, 4]], BAD_SHAPE, []),
    ("columnar-missing-input", "json", {"inputs": {"numeric": [[1, 2, 3, 4]]}}, BAD,
     ["category"]),
    ("columnar-extra-input", "json",
     {"inputs": {"numeric": [[1, 2, 3, 4]], "category": [1], "colour": [2]}}, BAD_KEY,
     ["colour"]),
    ("columnar-row-counts-differ", "json",
     {"inputs": {"numeric": [[1, 2, 3, 4], [5, 6, 7, 8]], "category": [1, 2, 3]}}, BAD_SHAPE,
     ["category"]),
    ("columnar-duplicate-input", "json",
     '{"inputs": {"numeric": [[1, 2, 3, 4]], "category": [1], "category": [2]}}', BAD,
     ["category"]),
    ("columnar-no-rows", "json", {"inputs": {"numeric": [], "category": []}}, BAD, []),
    ("columnar-float-for-int64", "json",
     {"inputs": {"numeric": [[1, 2, 3, 4], [5, 6, 7, 8]], "category": [1, 1.5]}}, BAD,
     ["category"]),
    ("columnar-wide-numeric", "json",
     {"inputs": {"numeric": [[1, 2, 3, 4, 5]], "category": [1]}}, BAD_SHAPE, ["numeric"]),
    ("npz-missing-input", "npz", {"numeric": NUM[:2]}, BAD, ["category"]),
    ("npz-extra-input", "npz", {"numeric": NUM[:2], "category": CAT[:2], "colour": CAT[:2]},
     BAD_KEY, ["colour"]),
    ("npz-row-counts-differ", "npz", {"numeric": NUM[:2], "category": CAT[:3]}, BAD_SHAPE,
     ["category"]),
    ("npz-float-for-int64", "npz", {"numeric": NUM[:2], "category": CAT[:2].astype(np.float64)},
     BAD, ["category"]),
    ("npz-wide-numeric", "npz", {"numeric": np.zeros((2, 5), np.float32), "category": CAT[:2]},
     BAD_SHAPE, ["numeric"]),
    ("v2-missing-input", "v2", [("numeric", NUM[:2], "FP32")], None, ["category"]),
    ("v2-extra-input", "v2",
     [("numeric", NUM[:2], "FP32"), ("category", CAT[:2], "INT64"), ("colour", CAT[:2], "INT64")],
     None, ["colour"]),
    ("v2-fp32-for-int64", "v2", [("numeric", NUM[:2], "FP32"), ("category", CAT[:2], "FP32")],
     None, ["category"]),
    ("v2-fp64-for-float32", "v2", [("numeric", NUM[:2], "FP64"), ("category", CAT[:2], "INT64")],
     None, ["numeric"]),
    ("v2-wide-numeric", "v2",
     [("numeric", np.zeros((2, 5), np.float32), "FP32"), ("category", CAT[:2], "INT64")],
     None, ["numeric"]),
    ("v2-row-counts-differ", "v2", [("numeric", NUM[:2], "FP32"), ("category", CAT[:3], "INT64")],
     None, ["category"]),
    ("v2-duplicate-input", "v2",
     [("numeric", NUM[:2], "FP32"), ("numeric", NUM[:2], "FP32"), ("category", CAT[:2], "INT64")],
     None, ["numeric"]),
    ("v1-missing-input", "v1", {"instances": [{"numeric": [1, 2, 3, 4]}]}, None, ["category"]),
    ("v1-float-for-int64", "v1", {"instances": [{"numeric": [1, 2, 3, 4], "category": 0.5}]},
     None, ["category"]),
]


@pytest.mark.parametrize("kind,body,codes,words", [c[1:] for c in REQUEST_ERRORS],
                         ids=[c[0] for c in REQUEST_ERRORS])
def test_request_errors_name_the_input(tab_server, kind, body, codes, words):
    srv = tab_server
    if kind == "json":
        error(post(srv, "/models/tab/predict", body), 400, codes, *words)
    elif kind == "npz":
        for compressed in (False, True):
            error(post_npz(srv, "/models/tab/predict", compressed, **body), 400, codes, *words)
    elif kind == "v2":
        for binary in (False, True):
            b, h = v2_body([v2_input(n, a, t, binary) for n, a, t in body])
            v2_error(post(srv, "/v2/models/tab/infer", b, headers=h), 400, *words)
    elif kind == "v1":
        v2_error(post(srv, "/v1/models/tab:predict", body), 400, *words)
    else:
        raise AssertionError(kind)
    # the server still answers a good request
    want = tab(NUM[:2], CAT[:2])
    b = ok_json(post(srv, "/models/tab/predict", objects(NUM[:2], CAT[:2])), "after the error")
    assert_outputs(rows_answer(b, TAB_NAMES, 2, "after"), want, "after the error")


def test_v2_binary_errors_name_the_input(tab_server):
    srv = tab_server
    # NaN in one input's raw floats
    x = NUM[:2].copy()
    x[1, 2] = np.nan
    body, headers = tab_v2(x, CAT[:2], binary=("numeric", "category"))
    v2_error(post(srv, "/v2/models/tab/infer", body, headers=headers), 400, "numeric")
    # the second input's binary_data_size is short of its shape's
    body, headers = tab_v2(NUM[:2], CAT[:2], order=("numeric", "category"),
                           binary=("numeric", "category"))
    n = int(headers["Inference-Header-Content-Length"])
    head = json.loads(body[:n])
    head["inputs"][1]["parameters"]["binary_data_size"] = 8
    hb = json.dumps(head).encode()
    v2_error(post(srv, "/v2/models/tab/infer", hb + body[n:-8],
                  headers={**headers, "Inference-Header-Content-Length": str(len(hb))}),
             400, "category", "binary_data_size")
    # the bytes of both, but the header claims fewer: bytes no input claims
    v2_error(post(srv, "/v2/models/tab/infer", hb + body[n:],
                  headers={**headers, "Inference-Header-Content-Length": str(len(hb))}), 400)


def test_npz_body_that_is_not_an_npz(tab_server):
    for body in (b"PK\x03\x04 not really", b"junk", b""):
        r = post(tab_server, "/models/tab/predict", body,
                 headers={"Content-Type": "application/x-npz"})
        assert r.status_code == 400, f"{body!r}: {r.status_code} {r.text!r}"
        assert r.json()["error"]["code"] not in (None, ""), r.text
    # an NPZ of a pickled object array is refused (never unpickled)
    r = post_npz(tab_server, "/models/tab/predict",
                 numeric=np.array([object()], dtype=object), category=CAT[:1])
    assert r.status_code == 400, r.text


# ---------------------------------------------------------------- jobs


JOB_ROWS = 300
COLS_NUMERIC = ["age", "bmi", "bp", "glucose"]


@pytest.fixture(scope="module")
def job_data(tmp_path_factory):
    """300 labelled rows of the tabular model: a CSV (columns in another
    order than the model's, plus one the job does not read), JSON Lines and
    NPZ; the expected outputs and PyTorch's own count of right labels."""
    d = tmp_path_factory.mktemp("mio_jobs")
    numeric, category = rng_rows(5, JOB_ROWS)
    want = tab(numeric, category)
    g = np.random.default_rng(11)
    truth = np.where(g.random(JOB_ROWS) < 0.6, want["logits"].argmax(1),
                     g.integers(0, 3, JOB_ROWS)).astype(np.int64)
    header = ["city_id", "note", "glucose", "age", "label", "bmi", "bp"]
    with open(d / "rows.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        for i in range(JOB_ROWS):
            cell = dict(zip(COLS_NUMERIC, [repr(float(v)) for v in numeric[i]]))
            cell.update(city_id=int(category[i]), note=f"row {i}", label=int(truth[i]))
            w.writerow([cell[h] for h in header])
    with open(d / "rows.jsonl", "w") as f:
        for i in range(JOB_ROWS):
            obj = {"city_id": int(category[i]), "label": int(truth[i]), "note": "x"}
            obj.update(zip(COLS_NUMERIC, [float(v) for v in numeric[i]]))
            f.write(json.dumps(obj) + "\n")
    with open(d / "named.jsonl", "w") as f:  # a field per input, by its name
        for i in range(JOB_ROWS):
            f.write(json.dumps({"label": int(truth[i]), "category": int(category[i]),
                                "numeric": [float(v) for v in numeric[i]]}) + "\n")
    np.savez(d / "rows.npz", numeric=numeric, category=category)
    np.savez_compressed(d / "labelled.npz", category=category, numeric=numeric, y=truth)
    ns = type("JobData", (), {})()
    ns.dir, ns.numeric, ns.category, ns.want, ns.truth = d, numeric, category, want, truth
    ns.correct = int((want["logits"].argmax(1) == truth).sum())
    return ns


@pytest.fixture
def jsrv(start_server, job_data, tmp_path):
    srv = start_server("--allowed-paths", f"{job_data.dir},{tmp_path}")
    deployed(srv, "tab", "tabular", TAB_CONFIG)
    return srv


COLUMNS = {"numeric": COLS_NUMERIC, "category": "city_id"}


def run_job(srv, spec, want="succeeded"):
    r = srv.request("POST", "/jobs", json=spec, timeout=10 * TSCALE)
    assert r.status_code == 202, f"POST /jobs {spec}: {r.status_code} {r.text}"
    jid = r.json()["id"]
    deadline = time.monotonic() + JOB_TIMEOUT * TSCALE
    while True:
        job = srv.get(f"/jobs/{jid}").json()
        if job["status"] in ("succeeded", "failed", "cancelled"):
            break
        assert time.monotonic() < deadline, f"job {jid} still {job['status']}"
        time.sleep(0.05)
    assert job["status"] == want, f"{job}\n{srv.stderr[-2000:]}"
    return jid, job


def check_jsonl(srv, jid, data, labelled=True):
    r = srv.get(f"/jobs/{jid}/output", timeout=30 * TSCALE)
    assert r.status_code == 200, r.text
    rows = [json.loads(line) for line in r.text.splitlines()]
    assert len(rows) == JOB_ROWS, f"{len(rows)} output lines"
    assert [row["index"] for row in rows] == list(range(JOB_ROWS))
    got = {k: np.array([row[k] for row in rows], dtype=np.float32) for k in TAB_NAMES}
    assert_outputs(got, data.want, "job output")
    preds = [LABELS[j] for j in data.want["logits"].argmax(1)]
    assert [row["prediction"] for row in rows] == preds, "prediction is the logits' argmax label"
    if labelled:
        assert [row["label"] for row in rows] == data.truth.tolist()
    return rows


def test_csv_job_with_columns(jsrv, job_data):
    spec = {"model": "tab", "input": {"path": str(job_data.dir / "rows.csv"), "format": "csv",
                                      "columns": COLUMNS, "label": "label"},
            "batch_size": 7}  # 300 rows: 42 forwards of 7 and one of 6
    jid, job = run_job(jsrv, spec)
    assert job["rows_done"] == JOB_ROWS and job["rows_skipped"] == 0, job
    assert job["labeled"] == JOB_ROWS and job["correct"] == job_data.correct, \
        f"correct {job['correct']}, PyTorch's count {job_data.correct}: {job}"
    check_jsonl(jsrv, jid, job_data)


def test_csv_job_csv_output_has_a_column_per_value(jsrv, job_data):
    spec = {"model": "tab", "input": {"path": str(job_data.dir / "rows.csv"), "format": "csv",
                                      "columns": COLUMNS, "label": "label"},
            "output": {"format": "csv"}}
    jid, job = run_job(jsrv, spec)
    r = jsrv.get(f"/jobs/{jid}/output", timeout=30 * TSCALE)
    assert r.status_code == 200, r.text
    rows = list(csv.DictReader(io.StringIO(r.text)))
    assert len(rows) == JOB_ROWS
    header = next(csv.reader(io.StringIO(r.text)))
    for name, width in (("logits", 3), ("embedding", 8)):
        cols = [f"{name}_{j}" for j in range(width)]
        assert [h for h in header if h.startswith(name + "_")] == cols, header
        got = np.array([[float(row[c]) for c in cols] for row in rows], dtype=np.float32)
        assert_close(got, job_data.want[name], f"CSV output {name}")
    assert [int(row["index"]) for row in rows] == list(range(JOB_ROWS)), header


def test_jsonl_job_with_columns(jsrv, job_data):
    spec = {"model": "tab", "input": {"path": str(job_data.dir / "rows.jsonl"), "format": "jsonl",
                                      "columns": COLUMNS, "label": "label"}}
    jid, job = run_job(jsrv, spec)
    assert job["labeled"] == JOB_ROWS and job["correct"] == job_data.correct, job
    check_jsonl(jsrv, jid, job_data)


def test_jsonl_job_fields_by_input_name(jsrv, job_data):
    """Without columns each input is the field of its name (openapi); a
    string in columns names one field holding the input's whole value."""
    path = str(job_data.dir / "named.jsonl")
    for inp in ({"path": path, "format": "jsonl", "label": "label"},
                {"path": path, "format": "jsonl", "label": "label",
                 "columns": {"numeric": "numeric", "category": "category"}}):
        jid, job = run_job(jsrv, {"model": "tab", "input": inp})
        assert job["labeled"] == JOB_ROWS and job["correct"] == job_data.correct, job
        check_jsonl(jsrv, jid, job_data)


def test_npz_job(jsrv, job_data):
    spec = {"model": "tab", "input": {"path": str(job_data.dir / "rows.npz"), "format": "npz"}}
    jid, job = run_job(jsrv, spec)
    assert job["rows_done"] == JOB_ROWS and job["rows_total"] == JOB_ROWS, job
    check_jsonl(jsrv, jid, job_data, labelled=False)
    # the format told by the path's .npz
    spec = {"model": "tab", "input": {"path": str(job_data.dir / "rows.npz")}}
    jid, job = run_job(jsrv, spec)
    check_jsonl(jsrv, jid, job_data, labelled=False)


def test_npz_job_with_a_label_array(jsrv, job_data):
    """savez_compressed, members in another order, `label` naming the array
    of labels: PyTorch's count of right answers."""
    spec = {"model": "tab", "input": {"path": str(job_data.dir / "labelled.npz"), "label": "y"},
            "batch_size": 64}
    jid, job = run_job(jsrv, spec)
    assert job["labeled"] == JOB_ROWS and job["correct"] == job_data.correct, job
    check_jsonl(jsrv, jid, job_data)


def test_npz_job_npy_output_is_refused_for_several_outputs(jsrv, job_data, tmp_path):
    """An NPY file holds one array: a version with several outputs writes a
    field per output (jsonl or csv). The job says so by name and writes
    nothing (the decision recorded in openapi's JobInput)."""
    out = tmp_path / "preds.npy"
    spec = {"model": "tab", "input": {"path": str(job_data.dir / "rows.npz"), "format": "npz"},
            "output": {"format": "npy", "path": str(out)}}
    jid, job = run_job(jsrv, spec, want="failed")
    msg = json.dumps(job["error"])
    assert "answers 2 outputs" in msg and "NPY file holds one array" in msg and "jsonl" in msg, job
    assert not out.exists(), "nothing is written for a refused job"


def test_csv_job_reads_integers_as_integers(jsrv, job_data, tmp_path):
    """A category cell that is not an integer is a malformed row naming the
    input: the job fails (on_error fail) or skips that row only."""
    lines = (job_data.dir / "rows.csv").read_text().splitlines()
    header = lines[0].split(",")
    cells = lines[3].split(",")
    cells[header.index("city_id")] = "2.5"
    lines[3] = ",".join(cells)
    bad = tmp_path / "bad.csv"
    bad.write_text("\n".join(lines) + "\n")
    spec = {"model": "tab", "input": {"path": str(bad), "format": "csv", "columns": COLUMNS,
                                      "label": "label"}}
    jid, job = run_job(jsrv, spec, want="failed")
    assert "category" in json.dumps(job["error"]) or "city_id" in json.dumps(job["error"]), job
    jid, job = run_job(jsrv, {**spec, "on_error": "skip"})
    assert job["rows_skipped"] == 1 and job["rows_done"] == JOB_ROWS, job
    r = jsrv.get(f"/jobs/{jid}/output", timeout=30 * TSCALE)
    rows = [json.loads(line) for line in r.text.splitlines()]
    assert [row["index"] for row in rows] == [i for i in range(JOB_ROWS) if i != 2], \
        "the skipped row is data row 2 (line 3)"
    keep = np.array([i for i in range(JOB_ROWS) if i != 2])
    got = {k: np.array([row[k] for row in rows], dtype=np.float32) for k in TAB_NAMES}
    assert_outputs(got, {k: v[keep] for k, v in job_data.want.items()}, "job output, row skipped")


def test_job_refuses_columns_that_do_not_fit(jsrv, job_data):
    """A column map naming no declared input, or missing one, is refused at
    POST (400) or fails the job naming the input."""
    for columns_, word in (({"numeric": COLS_NUMERIC}, "category"),
                           ({**COLUMNS, "colour": "note"}, "colour")):
        spec = {"model": "tab", "input": {"path": str(job_data.dir / "rows.csv"),
                                          "format": "csv", "columns": columns_}}
        r = jsrv.request("POST", "/jobs", json=spec, timeout=10 * TSCALE)
        if r.status_code == 202:
            jid = r.json()["id"]
            deadline = time.monotonic() + JOB_TIMEOUT * TSCALE
            while (job := jsrv.get(f"/jobs/{jid}").json())["status"] in ("queued", "running"):
                assert time.monotonic() < deadline, job
                time.sleep(0.05)
            assert job["status"] == "failed", job
            assert word in json.dumps(job["error"]), job
        else:
            assert r.status_code == 400, r.text
            assert word in r.json()["error"]["message"], r.text


# ---------------------------------------------------------------- training checkpoints


def test_state_dict_into_architecture_with_declared_io(server, tmp_path):
    """What a training loop writes (a torch.save state_dict) deployed into the
    model's architecture takes config.inputs and config.outputs the same way
    as a TorchScript version: the deploy's test forward checks them (a 422
    names what does not fit) and the answers are PyTorch's with those
    weights, integers exact."""
    arch = FIX / "tabular.pt"
    r = server.request("PUT", "/models/tsd/architecture", data=arch.read_bytes(),
                       timeout=60 * TSCALE)
    assert r.status_code in (200, 201), f"architecture: {r.status_code} {r.text}"
    m = torch.jit.load(str(arch))
    sd = {k: (v + 0.125 if v.is_floating_point() else v) for k, v in m.state_dict().items()}
    torch.save(sd, str(tmp_path / "sd.pt"))
    with open(tmp_path / "sd.pt", "rb") as f:
        r = requests.post(server.url + "/models/tsd/versions", files={"checkpoint": f},
                          data={"config": json.dumps(TAB_CONFIG)}, timeout=60 * TSCALE)
    assert r.status_code == 201, f"state_dict deploy: {r.status_code} {r.text}"
    assert r.json()["format"] == "torch_save", r.json()
    m.load_state_dict(sd)
    m.eval()
    with torch.no_grad():
        want = [t.numpy() for t in m(torch.from_numpy(NUM), torch.from_numpy(CAT))]
    body = ok_json(post(server, "/models/tsd/predict", objects(NUM, CAT)), "rows as objects")
    got = rows_answer(body, TAB_NAMES, len(NUM), "state_dict version")
    assert_outputs(got, dict(zip(TAB_NAMES, want)), "state_dict version")
    # the same checks as any deploy: an integer input declared float fails the test forward
    bad = {**TAB_CONFIG, "inputs": [TAB_INPUTS[0], {"name": "category", "shape": [],
                                                     "dtype": "float32"}]}
    with open(tmp_path / "sd.pt", "rb") as f:
        r = requests.post(server.url + "/models/tsd/versions", files={"checkpoint": f},
                          data={"config": json.dumps(bad)}, timeout=60 * TSCALE)
    assert r.status_code == 422, f"{r.status_code} {r.text}"
    assert r.json()["error"]["code"] in FORWARD_FAILS, r.text
