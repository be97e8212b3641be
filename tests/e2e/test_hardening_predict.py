"""
test_hardening_predict.py - requests that used to crash, corrupt or poison the
real binary (issue 10 items 1, 2, 6, 9; issue 9 item 2), each answered with a
clear JSON error while the server goes on serving:

- a config whose input.shape product overflows (the process aborted): 422
- a V2 infer whose shape product overflows or passes the value limit: 413
- a model whose output width depends on the batch (x @ x.t(), the committed
  fixture tests/fixtures/gram.pt), a request split over two forwards (a heap
  overflow): 500 bad_model_output
- a model deployed without input.shape whose first request, online or a job,
  has the wrong width (it fixed the shape until a restart): later requests of
  the right width still answer
- a job's top_k past the cap of 1000: 400

No test depends on the machine's speed: the only waits are bounded polls.
"""
import json
import time

import numpy as np
import requests

from conftest import REPO, TSCALE

FIXTURES = REPO / "tests" / "fixtures"
MLP_PT = FIXTURES / "mlp.pt"              # Linear(4, 8) -> ReLU -> Linear(8, 3)
GRAM_PT = FIXTURES / "gram.pt"            # x @ x.t()
MLP_IN = json.loads((FIXTURES / "mlp_input.json").read_text())      # [5, 4]
MLP_OUT = np.array(json.loads((FIXTURES / "mlp_expected.json").read_text()), dtype=np.float32)
ROW_LIMIT = 67108864  # MD_MAX_ROW_VALUES


def deploy(srv, name, path=MLP_PT, config=None):
    data = {"config": json.dumps(config)} if config is not None else {}
    with open(path, "rb") as f:
        return requests.post(srv.url + f"/models/{name}/versions", files={"checkpoint": f},
                             data=data, timeout=30 * TSCALE)


def deployed(srv, name, path=MLP_PT, config=None):
    r = deploy(srv, name, path, config)
    assert r.status_code == 201, f"deploy {name}: expected 201, got {r.status_code}: {r.text!r}"


def post_json(srv, path, body):
    return requests.post(srv.url + path, data=json.dumps(body),
                         headers={"Content-Type": "application/json"}, timeout=10 * TSCALE)


def error(resp, status, code=None):
    assert resp.status_code == status, \
        f"expected {status} {code}, got {resp.status_code}: {resp.text!r}"
    err = resp.json()["error"]
    if code is not None:
        assert err["code"] == code, f"expected code {code}: {resp.text!r}"
    return err["message"]


def still_serves(srv, name="alive"):
    """The process is up and a fresh deploy predicts correctly."""
    assert srv.get("/healthz").status_code == 200
    deployed(srv, name, config={"input": {"shape": [4]}})
    r = post_json(srv, f"/models/{name}/predict", MLP_IN)
    assert r.status_code == 200, r.text
    np.testing.assert_allclose(np.array(r.json()["predictions"], dtype=np.float32), MLP_OUT,
                               atol=1e-5)


# ------------------------------------------------------------ sizes (item 1)


def test_deploy_with_overflowing_input_shape_answers_422(server):
    for shape, shown in (([1073741824, 1073741824, 4], "4611686018427387904"),
                         ([1073741824, 1073741824, 1073741824], "more than 2^63"),
                         ([8192, 8193], "67117056")):
        r = deploy(server, "huge", config={"input": {"shape": shape}})
        msg = error(r, 422, "invalid_config")
        assert "config.input.shape" in msg and shown in msg and str(ROW_LIMIT) in msg, msg
    # nothing was stored, and the server goes on serving
    assert server.get("/models/huge").status_code == 404
    still_serves(server)


def test_v2_infer_with_huge_shape_answers_413(server):
    deployed(server, "mlp", config={"input": {"shape": [4]}})
    for shape in ([4611686018427387905, 4],       # the product wraps to 4 in 64 bits
                  [2147483648, 2147483648, 2147483648],
                  [100000000, 4]):               # no overflow, past the value limit
        r = post_json(server, "/v2/models/mlp/infer",
                      {"inputs": [{"name": "input0", "shape": shape, "datatype": "FP32",
                                   "data": [1, 2, 3, 4]}]})
        assert r.status_code == 413, f"shape {shape}: {r.status_code} {r.text!r}"
        body = r.json()
        assert "values" in body["error"] and "limit" in body["error"], body
    r = post_json(server, "/v2/models/mlp/infer",
                  {"inputs": [{"name": "input0", "shape": [1, 4], "datatype": "FP32",
                               "data": MLP_IN[0]}]})
    assert r.status_code == 200, r.text
    np.testing.assert_allclose(r.json()["outputs"][0]["data"], MLP_OUT[0], atol=1e-5)


# ------------------------------------------------------- split request (item 2)


def test_split_request_with_batch_dependent_output_answers_500(server):
    # with a declared input shape the deploy's test forwards (1 row, 2 rows)
    # see the output depend on the batch: refused, nothing stored
    r = deploy(server, "gram", GRAM_PT,
               {"input": {"shape": [3]}, "batching": {"max_batch_size": 4}, "workers": 2})
    msg = error(r, 422, "batch_dependent_output")
    assert "[1, 1]" in msg and "[2, 2]" in msg and "each computed from that row alone" in msg, msg
    assert server.get("/models/gram").status_code == 404
    # config-less, nothing tests it at deploy: the split check still holds
    deployed(server, "gram", GRAM_PT, {"batching": {"max_batch_size": 4}, "workers": 2})
    rows = [[float(r), 1.0, 2.0] for r in range(5)]
    # 5 rows over max_batch_size 4: forwards of 4 and 1 rows answer rows of 4
    # and 1 values; whichever finishes first, the request fails, once, clearly
    for _ in range(3):
        msg = error(post_json(server, "/models/gram/predict", rows), 500, "bad_model_output")
        assert "model gram returned rows of shape" in msg and "[4]" in msg and "[1]" in msg, msg
        assert "split" in msg and "max_batch_size" in msg, msg
    # a request that fits one forward answers x @ x.t()
    r = post_json(server, "/models/gram/predict", rows[:4])
    assert r.status_code == 200, r.text
    x = np.array(rows[:4], dtype=np.float32)
    np.testing.assert_allclose(np.array(r.json()["predictions"]), x @ x.T, atol=1e-5)
    still_serves(server)


# ------------------------------------------- config-less models (item 6, issue 9)


def test_configless_model_not_poisoned_by_a_bad_first_request(server):
    deployed(server, "bare")  # no config: the row shape is learned
    error(post_json(server, "/models/bare/predict", [[1, 2, 3]]), 422)
    # the right width still answers, and now fixes the shape
    r = post_json(server, "/models/bare/predict", MLP_IN)
    assert r.status_code == 200, r.text
    np.testing.assert_allclose(np.array(r.json()["predictions"], dtype=np.float32), MLP_OUT,
                               atol=1e-5)
    msg = error(post_json(server, "/models/bare/predict", [[1, 2, 3]]), 400, "wrong_shape")
    assert "expects rows of shape [4]" in msg, msg


def test_configless_model_not_poisoned_by_a_bad_first_job(start_server, tmp_path):
    srv = start_server("--allowed-paths", str(tmp_path))
    deployed(srv, "bare")
    data = tmp_path / "three.csv"
    data.write_text("a,b,c\n1,2,3\n4,5,6\n")
    r = srv.request("POST", "/jobs", json={"model": "bare",
                                           "input": {"path": str(data), "format": "csv"}},
                    timeout=10 * TSCALE)
    assert r.status_code == 202, r.text
    jid = r.json()["id"]
    deadline = time.monotonic() + 30 * TSCALE
    while True:
        job = srv.get(f"/jobs/{jid}").json()
        if job["status"] in ("succeeded", "failed", "cancelled"):
            break
        assert time.monotonic() < deadline, f"job still {job['status']}: {job}"
        time.sleep(0.05)
    assert job["status"] == "failed", job
    r = post_json(srv, "/models/bare/predict", MLP_IN)
    assert r.status_code == 200, r.text
    np.testing.assert_allclose(np.array(r.json()["predictions"], dtype=np.float32), MLP_OUT,
                               atol=1e-5)


# ------------------------------------------------------------ top_k (item 9)


def test_job_top_k_past_the_cap_answers_400(start_server, tmp_path):
    srv = start_server("--allowed-paths", str(tmp_path))
    deployed(srv, "mlp", config={"input": {"shape": [4]}})
    data = tmp_path / "four.csv"
    data.write_text("a,b,c,d\n1,2,3,4\n")
    spec = {"model": "mlp", "input": {"path": str(data), "format": "csv"}, "top_k": 1001}
    r = srv.request("POST", "/jobs", json=spec, timeout=10 * TSCALE)
    msg = error(r, 400, "invalid_job")
    assert "top_k" in msg and "1000" in msg, msg
    assert srv.get("/jobs").json()["jobs"] == [], "a refused job was stored"
    error(post_json(srv, "/models/mlp/predict?top_k=1001", MLP_IN), 400, "invalid_top_k")
    # top_k at the cap answers every class (3), best first, ties by index
    r = post_json(srv, "/models/mlp/predict?top_k=1000", MLP_IN)
    assert r.status_code == 200, r.text
    body = r.json()
    for row, labels, scores in zip(MLP_OUT, body["labels"], body["scores"]):
        assert labels == [int(i) for i in np.argsort(-row, kind="stable")], (row, labels)
        assert scores == sorted(scores, reverse=True)
