"""
test_prepack.py - a version's pool of prepacked copies (config "prepack",
setting prepack_max_bytes, a bound on the copies together): the linear
layers of the forward run as XNNPACK's prepacked linear instead of an
OpenBLAS sgemm that packs the weights on every call.

What users see, against the real binary and real libtorch models:
- answers equal plain PyTorch's (torch.jit.load + forward, computed here)
  within float rounding, under concurrent clients on two workers (the packed
  operators keep per-call state, so a copy serves one forward at a time; that
  no copy is ever used by two threads at once is checked deterministically by
  tests/test_batcher.c's fake backend, since a race here shows only rarely:
  two Python threads sharing one crashed within a second);
- with prepacking a row's answer is the same, bit for bit, alone or batched
  with 63 others;
- GET /models/NAME says how many packed copies the version holds;
  "prepack": false, a prepack_max_bytes smaller than the weights, weights
  computed in forward, float64 models and a CNN are served as before;
- a config with a non-boolean "prepack" is refused (422) and nothing stored.
"""
import gzip
import json
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import requests

from conftest import REPO, TSCALE

torch = pytest.importorskip("torch")

FASHION_PT = REPO / "examples" / "fashion_mnist" / "model.pt"
FASHION_CONFIG = json.loads((REPO / "examples" / "fashion_mnist" / "model.json").read_text())
FIXTURES = REPO / "tests" / "fixtures"
CNN_PT = FIXTURES / "cnn.pt"
CNN_IN = json.loads((FIXTURES / "cnn_input.json").read_text())
CNN_OUT = np.array(json.loads((FIXTURES / "cnn_expected.json").read_text()), dtype=np.float32)
DATASET = "/usr/share/datasets/fashion-mnist/t10k-images-idx3-ubyte.gz"
# XNNPACK sums in another order than OpenBLAS: on the 10k test set the
# logits (up to ~43) differ by at most 1.9e-5; OpenBLAS itself differs by
# 4e-6 between batch sizes.
ATOL = 1e-4


def fashion_rows(n):
    with gzip.open(DATASET) as f:
        x = np.frombuffer(f.read()[16:16 + n * 784], dtype=np.uint8)
    return x.reshape(n, 28, 28)


def eager(path, x, dtype=torch.float32):
    m = torch.jit.load(str(path)).eval()
    with torch.no_grad():
        return m(torch.from_numpy(np.asarray(x)).to(dtype)).float().numpy()


def deploy(srv, name, path, config):
    with open(path, "rb") as f:
        return requests.post(srv.url + f"/models/{name}/versions", files={"checkpoint": f},
                             data={"config": json.dumps(config)}, timeout=30 * TSCALE)


def deployed(srv, name, path, config):
    r = deploy(srv, name, path, config)
    assert r.status_code == 201, f"deploy {name}: {r.status_code} {r.text}"


def predict(srv, name, rows, session=None):
    r = (session or requests).post(srv.url + f"/models/{name}/predict",
                                   data=json.dumps({"instances": rows}),
                                   headers={"Content-Type": "application/json"},
                                   timeout=30 * TSCALE)
    assert r.status_code == 200, f"{r.status_code} {r.text}"
    return r.json()["predictions"]


def prepacked_workers(srv, name, want=None):
    """The loaded version's prepacked_workers; with `want`, wait (bounded) for
    it: online workers pack right after the load."""
    import time
    deadline = time.monotonic() + 10 * TSCALE
    while True:
        r = srv.get(f"/models/{name}")
        assert r.status_code == 200, r.text
        loaded = r.json()["loaded"]
        assert len(loaded) == 1, loaded
        n = loaded[0]["prepacked_workers"]
        if want is None or n == want or time.monotonic() > deadline:
            return n
        time.sleep(0.02)


def test_prepacked_answers_match_pytorch_under_concurrent_clients(server):
    cfg = {**FASHION_CONFIG, "workers": 2}
    deployed(server, "fashion", FASHION_PT, cfg)
    assert prepacked_workers(server, "fashion", 2) == 2
    x = fashion_rows(512)
    want = eager(FASHION_PT, x.astype(np.float32) / 255.0)
    # requests of 1, 3 and 16 rows from 8 clients at once, so batches mix
    # them and both workers forward at the same time
    spans, i, sizes = [], 0, [1, 3, 16, 1, 1, 5]
    while i < len(x):
        k = min(sizes[len(spans) % len(sizes)], len(x) - i)
        spans.append((i, k))
        i += k

    def one(span):
        s, k = span
        with requests.Session() as sess:
            return s, np.array(predict(server, "fashion", x[s:s + k].tolist(), sess),
                               dtype=np.float32)

    for _ in range(4):
        with ThreadPoolExecutor(16) as pool:
            for s, got in pool.map(one, spans):
                np.testing.assert_allclose(got, want[s:s + len(got)], rtol=0, atol=ATOL,
                                           err_msg=f"rows {s}..{s + len(got)}")
    r = server.get("/models/fashion")
    stats = r.json()["loaded"][0]
    assert stats["rows"] >= 2 * len(x), stats
    assert stats["prepacked_workers"] == 2, stats


def test_prepacked_row_is_the_same_alone_or_batched(server):
    deployed(server, "fashion", FASHION_PT, FASHION_CONFIG)
    assert prepacked_workers(server, "fashion", 2) == 2
    x = fashion_rows(64).tolist()
    batch = predict(server, "fashion", x)
    for i in (0, 7, 31, 63):
        alone = predict(server, "fashion", [x[i]])[0]
        assert alone == batch[i], f"row {i}: alone {alone} != batched {batch[i]}"


def test_prepack_off_and_bounds(start_server):
    # the fashion model's linear weights are 2,674,688 bytes
    srv = start_server("--prepack-max-bytes", "2674687")
    x = fashion_rows(8)
    want = eager(FASHION_PT, x.astype(np.float32) / 255.0)
    deployed(srv, "big", FASHION_PT, FASHION_CONFIG)
    deployed(srv, "off", FASHION_PT, {**FASHION_CONFIG, "prepack": False})
    for name in ("big", "off"):
        np.testing.assert_allclose(predict(srv, name, x.tolist()), want, rtol=0, atol=ATOL)
        assert prepacked_workers(srv, name) == 0
    assert "not prepacked: its linear weights are 2674688 bytes" in srv.stderr
    assert "more than prepack_max_bytes (2674687)" in srv.stderr
    # the bound is all the packed copies of a version together, one per
    # forward that can run at once (per core, two workers here): room for
    # fewer is no packing at all; room for them all, all of them
    cores = min(2, len(os.sched_getaffinity(0)))
    srv2 = start_server("--prepack-max-bytes", str(cores * 2674688 - 1), "--workers", "2")
    deployed(srv2, "short", FASHION_PT, FASHION_CONFIG)
    np.testing.assert_allclose(predict(srv2, "short", x.tolist()), want, rtol=0, atol=ATOL)
    assert prepacked_workers(srv2, "short") == 0
    srv2b = start_server("--prepack-max-bytes", str(cores * 2674688), "--workers", "2")
    deployed(srv2b, "fits", FASHION_PT, FASHION_CONFIG)
    assert prepacked_workers(srv2b, "fits", cores) == cores
    np.testing.assert_allclose(predict(srv2b, "fits", x.tolist()), want, rtol=0, atol=ATOL)
    srv3 = start_server("--prepack-max-bytes", "0")
    deployed(srv3, "never", FASHION_PT, FASHION_CONFIG)
    np.testing.assert_allclose(predict(srv3, "never", x.tolist()), want, rtol=0, atol=ATOL)
    assert prepacked_workers(srv3, "never") == 0


class Computed(torch.nn.Module):
    """A linear whose weight is computed in forward (from the input's shape, so
    rows stay independent): freezing cannot make it a constant, so there is
    nothing to pack once."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.w = torch.nn.Parameter(torch.randn(5, 4))
        self.b = torch.nn.Parameter(torch.randn(5))

    def forward(self, x):
        return torch.nn.functional.linear(x, self.w * (x.size(0) // x.size(0)), self.b)


class InPlace(torch.nn.Module):
    """In-place writes to a linear's input right before it and to its output
    right after: the packed linear must run exactly where the linear was."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(8)
        self.a = torch.nn.Linear(4, 5)
        self.b = torch.nn.Linear(5, 3)

    def forward(self, x):
        x = x * 1.0
        x[:, 0] = 42.0
        h = self.a(x)
        h.add_(100.0)
        h.mul_(0.5)
        y = self.b(h)
        y[:, 1] = -1.0
        return y


class Branches(torch.nn.Module):
    """Linears inside If branches (chosen by the input's width) stay as they
    are; the one outside is packed."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(9)
        self.a = torch.nn.Linear(4, 3)
        self.b = torch.nn.Linear(3, 3)
        self.out = torch.nn.Linear(3, 2)

    def forward(self, x):
        if x.size(1) == 4:
            h = self.a(x)
        else:
            h = self.b(x)
        return self.out(torch.relu(h))


class Mixed(torch.nn.Module):
    """A packable linear, then one computed from the input."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(4)
        self.a = torch.nn.Linear(4, 6)
        self.w = torch.nn.Parameter(torch.randn(3, 6))

    def forward(self, x):
        h = torch.relu(self.a(x))
        return torch.nn.functional.linear(h, self.w * (h.size(0) // h.size(0)), None)


def test_packing_keeps_every_kind_of_model_s_answers(server, tmp_path):
    x = np.random.default_rng(5).standard_normal((6, 4)).astype(np.float32)
    for name, module, dtype, cfg in [
        ("computed", Computed(), torch.float32, {"input": {"shape": [4]}}),
        ("mixed", Mixed(), torch.float32, {"input": {"shape": [4]}}),
        ("inplace", InPlace(), torch.float32, {"input": {"shape": [4]}}),
        ("branches", Branches(), torch.float32, {"input": {"shape": [4]}}),
        ("double", torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU()).double(),
         torch.float64, {"input": {"shape": [4], "dtype": "float64"}}),
    ]:
        path = tmp_path / f"{name}.pt"
        torch.jit.script(module.eval()).save(str(path))
        deployed(server, name, path, cfg)
        got = np.array(predict(server, name, x.tolist()), dtype=np.float32)
        want = eager(path, x, dtype)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=name)
        # one row at a time too: the test forward and later batches agree
        got1 = np.array(predict(server, name, [x[2].tolist()]), dtype=np.float32)
        np.testing.assert_allclose(got1[0], want[2], rtol=1e-5, atol=1e-5, err_msg=name)
    # the CNN fixture (conv layers are left alone, its linear is packed)
    deployed(server, "cnn", CNN_PT, {"input": {"shape": [1, 8, 8]}})
    np.testing.assert_allclose(predict(server, "cnn", CNN_IN), CNN_OUT, rtol=0, atol=1e-5)
    for name in ("mixed", "inplace", "branches", "cnn"):
        assert prepacked_workers(server, name, 2) == 2, name
    assert prepacked_workers(server, "double") == 0
    assert prepacked_workers(server, "computed") == 0
    assert "the model's linear layers could not be prepacked" not in server.stderr, server.stderr
    assert "forwarding without prepacking" not in server.stderr, server.stderr


@pytest.mark.parametrize("value", ["yes", 1, None, [True]])
def test_prepack_must_be_a_boolean(server, value):
    r = deploy(server, "fashion", FASHION_PT, {**FASHION_CONFIG, "prepack": value})
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["code"] == "invalid_config", err
    assert "prepack" in err["message"] and "true" in err["message"], err
    assert server.get("/models/fashion").status_code == 404


def test_rows_of_another_width_are_refused_not_read_past_their_end(server, tmp_path):
    """libtorch 1.13's XNNPACK linear never compares the input's width with the
    weight's, so a row of 3 values into Linear(4, 3) would be read past its
    end; the packed copy checks the width, and the answer is PyTorch's own
    error. The worker keeps its packed copy (the module fails such rows too)."""
    torch.manual_seed(6)
    path = tmp_path / "lin.pt"
    torch.jit.script(torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU()).eval()).save(
        str(path))
    # no input.shape: a model learns its row width from its first successful
    # forward, so until then rows of any width reach the forward
    deployed(server, "lin", path, {})
    good = np.random.default_rng(7).standard_normal((2, 4)).astype(np.float32)
    assert prepacked_workers(server, "lin", 2) == 2
    for width in (1, 3, 5, 8):
        r = requests.post(server.url + "/models/lin/predict",
                          data=json.dumps({"instances": [[0.5] * width] * 2}),
                          headers={"Content-Type": "application/json"}, timeout=30 * TSCALE)
        assert r.status_code == 422, (width, r.text)
        msg = r.json()["error"]["message"]
        assert "mat1 and mat2 shapes cannot be multiplied" in msg, (width, msg)
    np.testing.assert_allclose(predict(server, "lin", good.tolist()), eager(path, good),
                               rtol=1e-5, atol=1e-6)
    assert prepacked_workers(server, "lin") == 2
    assert "forwarding without prepacking" not in server.stderr
