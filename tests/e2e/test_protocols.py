"""
test_protocols.py - the wire formats other serving systems' clients speak,
against the real binary:

- the Open Inference Protocol's binary tensor data extension, as Triton's
  `tritonclient.http` sends it (its defaults: inputs as raw bytes after the
  JSON header, `Inference-Header-Content-Length`, `binary_data_size`; outputs
  asked for as binary), for every numeric datatype, FP16 included, and its
  errors;
- the KServe V1 data plane (TF Serving's REST shape): POST
  /v1/models/NAME:predict with {"instances": ...} answering {"predictions":
  ...}, GET /v1/models/NAME readiness, and its errors.

tritonclient is not packaged for Debian, so the requests are built here the
way its `InferInput.set_data_from_numpy(binary_data=True)` and
`InferRequestedOutput(binary_data=True)` build them. Expected outputs are the
committed fixtures computed by Torch (1e-5).
"""
import json

import numpy as np
import pytest

from conftest import REPO

FIXTURES = REPO / "tests" / "fixtures"
MLP_PT = FIXTURES / "mlp.pt"
MLP_IN = np.array(json.loads((FIXTURES / "mlp_input.json").read_text()), dtype=np.float32)
MLP_OUT = np.array(json.loads((FIXTURES / "mlp_expected.json").read_text()), dtype=np.float32)
MLP_CONFIG = {"input": {"shape": [4]}, "output": "logits"}
TOL = 1e-5

DTYPES = {"FP32": np.float32, "FP64": np.float64, "FP16": np.float16, "INT64": np.int64,
          "INT32": np.int32, "INT16": np.int16, "INT8": np.int8, "UINT64": np.uint64,
          "UINT32": np.uint32, "UINT16": np.uint16, "UINT8": np.uint8, "BOOL": np.bool_}


def deploy_mlp(srv):
    with open(MLP_PT, "rb") as f:
        r = srv.request("POST", "/models/mlp/versions", files={"checkpoint": f},
                        data={"config": json.dumps(MLP_CONFIG)})
    assert r.status_code == 201, r.text


def binary_request(arr, datatype, binary_output=True, id_=None, json_data=False):
    """The body and headers tritonclient.http sends for one input."""
    raw = arr.astype(DTYPES[datatype]).tobytes()  # little-endian on x86
    inp = {"name": "input0", "shape": list(arr.shape), "datatype": datatype}
    if json_data:
        inp["data"] = arr.astype(DTYPES[datatype]).flatten().tolist()
        raw = b""
    else:
        inp["parameters"] = {"binary_data_size": len(raw)}
    req = {"inputs": [inp], "outputs": [{"name": "logits",
                                         "parameters": {"binary_data": binary_output}}]}
    if id_:
        req["id"] = id_
    head = json.dumps(req).encode()
    headers = {"Content-Type": "application/octet-stream",
               "Inference-Header-Content-Length": str(len(head))}
    return head + raw, headers


def binary_response(r):
    """Split a binary-output answer: (JSON header, float32 values)."""
    assert r.status_code == 200, r.text
    n = int(r.headers["Inference-Header-Content-Length"])
    head = json.loads(r.content[:n])
    out = head["outputs"][0]
    assert "data" not in out, out
    size = out["parameters"]["binary_data_size"]
    assert out["datatype"] == "FP32"
    assert len(r.content) == n + size, (len(r.content), n, size)
    return head, np.frombuffer(r.content[n:], dtype="<f4").reshape(out["shape"])


def test_v2_lists_the_extension(shared_server):
    r = shared_server.request("GET", "/v2")
    assert r.status_code == 200, r.text
    assert "binary_tensor_data" in r.json()["extensions"]


def test_binary_in_binary_out(server):
    deploy_mlp(server)
    body, headers = binary_request(MLP_IN, "FP32", id_="7")
    r = server.request("POST", "/v2/models/mlp/infer", data=body, headers=headers)
    head, got = binary_response(r)
    assert r.headers["Content-Type"].startswith("application/octet-stream")
    assert head["id"] == "7" and head["model_name"] == "mlp" and head["model_version"] == "1"
    assert head["outputs"][0]["name"] == "logits"
    assert got.shape == MLP_OUT.shape
    assert np.abs(got - MLP_OUT).max() <= TOL
    # the same through the version route
    r = server.request("POST", "/v2/models/mlp/versions/1/infer", data=body, headers=headers)
    assert np.abs(binary_response(r)[1] - MLP_OUT).max() <= TOL


@pytest.mark.parametrize("datatype", sorted(DTYPES))
def test_every_datatype_binary(server, datatype):
    """Every numeric datatype is converted to float32 as numpy converts it."""
    deploy_mlp(server)
    if datatype == "BOOL":
        x = (MLP_IN > 0)
    elif datatype.startswith(("INT", "UINT")):
        x = np.abs(np.round(MLP_IN * 3))  # small non-negative integers, exact in any type
    else:
        x = MLP_IN
    typed = x.astype(DTYPES[datatype])
    body, headers = binary_request(typed, datatype)
    r = server.request("POST", "/v2/models/mlp/infer", data=body, headers=headers)
    got = binary_response(r)[1]
    # the model's answer on the float32 values numpy makes of the typed ones
    body, headers = binary_request(typed.astype(np.float32), "FP32")
    want = binary_response(server.request("POST", "/v2/models/mlp/infer", data=body,
                                          headers=headers))[1]
    assert got.tobytes() == want.tobytes(), datatype


def test_binary_in_json_out_and_json_in_binary_out(server):
    deploy_mlp(server)
    body, headers = binary_request(MLP_IN, "FP32", binary_output=False)
    r = server.request("POST", "/v2/models/mlp/infer", data=body, headers=headers)
    assert r.status_code == 200, r.text
    assert "Inference-Header-Content-Length" not in r.headers
    out = r.json()["outputs"][0]
    assert np.abs(np.array(out["data"], np.float32).reshape(out["shape"]) - MLP_OUT).max() <= TOL
    # JSON data in, binary out asked for by the request-level parameter
    req = {"inputs": [{"name": "input0", "shape": [5, 4], "datatype": "FP32",
                       "data": MLP_IN.flatten().tolist()}],
           "parameters": {"binary_data_output": True}}
    r = server.request("POST", "/v2/models/mlp/infer", data=json.dumps(req),
                       headers={"Content-Type": "application/json"})
    assert np.abs(binary_response(r)[1] - MLP_OUT).max() <= TOL


def test_fp16_values(server):
    """FP16 bits, subnormals included, become the float32 numpy makes of them."""
    deploy_mlp(server)
    x = np.array([[1.0, -0.5, 6.1e-5, 65504.0], [5.96e-8, -0.0, 0.333, -2.0]], dtype=np.float16)
    body, headers = binary_request(x, "FP16")
    got = binary_response(server.request("POST", "/v2/models/mlp/infer", data=body,
                                         headers=headers))[1]
    body, headers = binary_request(x.astype(np.float32), "FP32")
    want = binary_response(server.request("POST", "/v2/models/mlp/infer", data=body,
                                          headers=headers))[1]
    assert got.tobytes() == want.tobytes()


def v2_error(r, status, *words):
    assert r.status_code == status, (r.status_code, r.text)
    msg = r.json()["error"]
    assert isinstance(msg, str)
    for w in words:
        assert w in msg, (w, msg)
    return msg


def test_binary_errors(server):
    deploy_mlp(server)
    url = "/v2/models/mlp/infer"
    body, headers = binary_request(MLP_IN, "FP32")
    n = int(headers["Inference-Header-Content-Length"])
    # the data is one value short of the shape's
    v2_error(server.request("POST", url, data=body[:-4],
                            headers=headers), 400, "binary_data_size")
    # binary_data_size says 20 bytes, but shape [5, 4] of FP32 takes 80
    head = json.loads(body[:n])
    head["inputs"][0]["parameters"]["binary_data_size"] = 20
    hb = json.dumps(head).encode()
    v2_error(server.request("POST", url, data=hb + body[n:n + 20],
                            headers={**headers, "Inference-Header-Content-Length": str(len(hb))}),
             400, "binary_data_size", "80")
    # the header length past the body, not a number, zero
    for bad in (str(len(body) + 1), "abc", "0", "-5"):
        v2_error(server.request("POST", url, data=body,
                                headers={**headers, "Inference-Header-Content-Length": bad}),
                 400, "Inference-Header-Content-Length")
    # binary_data_size without the header
    v2_error(server.request("POST", url, data=body,
                            headers={"Content-Type": "application/octet-stream"}), 400)
    # bytes after the JSON that no input claims
    body2, headers2 = binary_request(MLP_IN, "FP32", json_data=True)
    v2_error(server.request("POST", url, data=body2 + b"\0\0\0\0", headers=headers2), 400,
             "binary_data_size")
    # NaN and infinity in the raw values
    x = MLP_IN.copy()
    x[1, 2] = np.nan
    body3, headers3 = binary_request(x, "FP32")
    v2_error(server.request("POST", url, data=body3, headers=headers3), 400, "value 6")
    x = MLP_IN.astype(np.float64)
    x[0, 0] = 1e300
    body4, headers4 = binary_request(x, "FP64")
    v2_error(server.request("POST", url, data=body4, headers=headers4), 400, "float32")
    # a datatype modeld does not read
    head = json.loads(body[:n])
    head["inputs"][0]["datatype"] = "BYTES"
    hb = json.dumps(head).encode()
    v2_error(server.request("POST", url, data=hb + body[n:],
                            headers={**headers, "Inference-Header-Content-Length": str(len(hb))}),
             400, "BYTES")
    # a shape too big for the body limit is refused before any allocation
    head = json.loads(body[:n])
    head["inputs"][0]["shape"] = [1 << 40, 4]
    hb = json.dumps(head).encode()
    v2_error(server.request("POST", url, data=hb + body[n:],
                            headers={**headers, "Inference-Header-Content-Length": str(len(hb))}),
             413)
    # the server still answers
    body, headers = binary_request(MLP_IN, "FP32")
    assert np.abs(binary_response(server.request("POST", url, data=body, headers=headers))[1]
                  - MLP_OUT).max() <= TOL


def decoded_off_thread(srv):
    for line in srv.request("GET", "/metrics").text.splitlines():
        if line.startswith("modeld_http_decoded_off_thread_total "):
            return float(line.split()[1])
    raise AssertionError("/metrics has no modeld_http_decoded_off_thread_total")


def test_large_json_requests(server):
    """A V2 request with its data in JSON (what a client without the binary
    extension sends: 4000 rows of full-precision floats, over 64 KiB) is read
    on the decode pool, its data array by the row scanner: the answer is the
    binary path's bit for bit, flat or nested, and every error names what it
    did before."""
    deploy_mlp(server)
    url = "/v2/models/mlp/infer"
    x = np.random.default_rng(7).standard_normal((4000, 4)).astype(np.float32)
    body, headers = binary_request(x, "FP32")
    want = binary_response(server.request("POST", url, data=body, headers=headers))[1]
    assert want.shape == (4000, 3)

    before = decoded_off_thread(server)
    for data in (x.flatten().tolist(), x.tolist()):  # the spec's flat form, and nested
        req = {"id": "big", "inputs": [{"name": "input0", "shape": [4000, 4],
                                        "datatype": "FP32", "data": data}],
               "outputs": [{"name": "logits", "parameters": {"binary_data": True}}]}
        text = json.dumps(req)
        assert len(text) > 64 * 1024
        r = server.request("POST", url, data=text, headers={"Content-Type": "application/json"})
        head, got = binary_response(r)
        assert head["id"] == "big" and head["outputs"][0]["name"] == "logits"
        assert got.tobytes() == want.tobytes()
    assert decoded_off_thread(server) == before + 2

    # JSON out too, and the data last in its object
    req = {"inputs": [{"shape": [4000, 4], "datatype": "FP32", "name": "input0",
                       "data": x.flatten().tolist()}]}
    r = server.request("POST", url, json=req)
    assert r.status_code == 200, r.text
    out = r.json()["outputs"][0]
    assert np.array_equal(np.array(out["data"], np.float32).reshape(out["shape"]), want)

    # errors are those of the whole-body reading, as for a small request
    data = x.flatten().tolist()
    data[9999] = "x"
    req = {"inputs": [{"name": "input0", "shape": [4000, 4], "datatype": "FP32", "data": data}]}
    v2_error(server.request("POST", url, json=req), 400, "value 9999 is not a number")
    req["inputs"][0]["data"] = x.flatten().tolist()[:-1]
    v2_error(server.request("POST", url, json=req), 400, "15999 values but its shape needs 16000")
    req["inputs"][0]["data"] = [[1.0] * 4] * 3999 + [[1.0] * 3]  # ragged, 15999 values
    v2_error(server.request("POST", url, json=req), 400, "15999 values")
    text = json.dumps({"inputs": [{"shape": [4000, 4], "datatype": "FP32",
                                   "data": x.flatten().tolist()}]})
    v2_error(server.request("POST", url, data=text[:-2],
                            headers={"Content-Type": "application/json"}), 400,
             "not a JSON inference request")
    # a model that is not there: 404, the body unread
    v2_error(server.request("POST", "/v2/models/nope/infer", data=text,
                            headers={"Content-Type": "application/json"}), 404)
    # the server still answers
    assert binary_response(server.request("POST", url, data=body, headers=headers))[1].tobytes() \
        == want.tobytes()


# ---------------------------------------------------------------- KServe V1


def test_v1_predict_and_ready(server):
    r = server.request("GET", "/v1/models/mlp")
    v2_error(r, 404, "mlp")
    deploy_mlp(server)
    r = server.request("GET", "/v1/models/mlp")
    assert r.status_code == 200, r.text
    assert r.json() == {"name": "mlp", "ready": True, "loaded": True}
    r = server.request("POST", "/v1/models/mlp:predict",
                       data=json.dumps({"instances": MLP_IN.tolist()}),
                       headers={"Content-Type": "application/json"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert list(body) == ["predictions"], body
    assert np.abs(np.array(body["predictions"], np.float32) - MLP_OUT).max() <= TOL
    # the V1 answer is JSON whatever Accept asks for
    r = server.request("POST", "/v1/models/mlp:predict",
                       data=json.dumps({"instances": MLP_IN.tolist()}),
                       headers={"Content-Type": "application/json", "Accept": "application/x-npy"})
    assert r.status_code == 200 and list(r.json()) == ["predictions"], r.text


def test_v1_errors(server):
    deploy_mlp(server)
    # a ragged instance: the V1 error shape, naming the row
    r = server.request("POST", "/v1/models/mlp:predict",
                       data=json.dumps({"instances": [[1, 2, 3, 4], [1, 2]]}),
                       headers={"Content-Type": "application/json"})
    v2_error(r, 400, "row 1")
    r = server.request("POST", "/v1/models/nope:predict", data=json.dumps({"instances": [[1]]}),
                       headers={"Content-Type": "application/json"})
    v2_error(r, 404, "nope")
    # another verb is not a route; POST without a verb neither
    r = server.request("POST", "/v1/models/mlp:explain", data="{}")
    assert r.status_code == 405, r.text
    assert r.headers["Allow"] == "GET"
    r = server.request("POST", "/v1/models/mlp", data="{}")
    assert r.status_code == 405, r.text
