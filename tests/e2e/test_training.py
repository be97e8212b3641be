"""
test_training.py - training checkpoints over HTTP against the real binary
(issue 12): an architecture PUT once, then what a training loop writes
(torch.save state_dicts in every common shape, safetensors) uploaded as
versions; predictions equal PyTorch eager with the same weights; a malicious
pickle refused with nothing run and nothing stored; strict loading's 422s;
export to safetensors bit for bit; weight averaging equal to PyTorch's;
the promotion policy, across a restart.

PyTorch runs in this process (the e2e suite runs under Debian's
/usr/bin/python3, which has python3-torch) to compute the expected outputs
from the very files uploaded; the fixtures are tests/fixtures/ckpt/, made by
tests/fixtures/make_ckpt_fixtures.py.
"""
import collections
import hashlib
import io
import json
import os
import struct
import subprocess
import time

import numpy as np
import pytest
import requests

from conftest import REPO, TSCALE

torch = pytest.importorskip("torch")
nn = torch.nn

FIX = REPO / "tests" / "fixtures"
CK = FIX / "ckpt"
MLP_INPUT = np.load(FIX / "mlp_input.npy").astype(np.float32)
CNN_INPUT = np.load(FIX / "cnn_input.npy").astype(np.float32)
MLP_CONFIG = {"input": {"shape": [4]}}
BN_CONFIG = {"input": {"shape": [1, 8, 8]}}
PWNED = "/tmp/modeld-pwned-5d41402abc4b"  # what the evil_*.pt fixtures would create
T = 60 * TSCALE


class MLP(nn.Module):  # the MLP of the fixture scripts
    def __init__(self, hidden=8):
        super().__init__()
        self.fc1 = nn.Linear(4, hidden)
        self.relu = nn.ReLU()
        self.fc2 = nn.Linear(hidden, 3)

    def forward(self, x):
        return self.fc2(self.relu(self.fc1(x)))


class BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3)
        self.bn = nn.BatchNorm2d(2)
        self.relu = nn.ReLU()
        self.fc = nn.Linear(2 * 6 * 6, 4)

    def forward(self, x):
        x = self.relu(self.bn(self.conv(x)))
        return self.fc(torch.flatten(x, 1))


# ---------------------------------------------------------------- helpers

def read_safetensors(data):
    """{name: numpy array} and the metadata of a safetensors file."""
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    meta = header.pop("__metadata__", {})
    kinds = {"F32": "<f4", "F64": "<f8", "F16": "<f2", "I64": "<i8", "I32": "<i4",
             "U8": "u1", "I8": "i1", "BOOL": "u1", "I16": "<i2"}
    out = collections.OrderedDict()
    for name, d in header.items():
        a, b = d["data_offsets"]
        if d["dtype"] == "BF16":
            raw = np.frombuffer(data[8 + n + a:8 + n + b], dtype="<u2").astype(np.uint32) << 16
            arr = raw.view(np.float32)
        else:
            arr = np.frombuffer(data[8 + n + a:8 + n + b], dtype=kinds[d["dtype"]])
        out[name] = arr.reshape(d["shape"])
    return out, meta


def file_state(path):
    """The state_dict in a fixture file, as PyTorch sees it (trusted fixtures)."""
    if str(path).endswith(".safetensors"):
        tensors, _ = read_safetensors(path.read_bytes())
        return {k: torch.from_numpy(np.array(v)) for k, v in tensors.items()}
    obj = torch.load(path)
    for key in ("model", "state_dict", "model_state_dict"):
        if isinstance(obj, dict) and key in obj and isinstance(obj[key], dict):
            obj = obj[key]
    return {(k[7:] if k.startswith("module.") else k): v for k, v in obj.items()
            if isinstance(v, torch.Tensor)}


def eager(net, state, x):
    net.load_state_dict(state)  # strict; converts f16/bf16/f64 into the float32 net
    net.eval()
    with torch.no_grad():
        return net(torch.from_numpy(x)).numpy()


def put_arch(s, name, path, multipart=False):
    if multipart:
        return s.request("PUT", f"/models/{name}/architecture",
                         files={"architecture": ("arch.pt", path.read_bytes())}, timeout=T)
    return s.request("PUT", f"/models/{name}/architecture", data=path.read_bytes(),
                     headers={"Content-Type": "application/octet-stream"}, timeout=T)


def upload(s, name, data, **fields):
    form = {k: (None, json.dumps(v) if isinstance(v, (dict, list)) else str(v))
            for k, v in fields.items()}
    form["checkpoint"] = ("ckpt", data)
    return requests.post(s.url + f"/models/{name}/versions", files=form, timeout=T)


def created(r):
    assert r.status_code == 201, r.text
    return r.json()


def predict(s, name, version, x):
    r = requests.post(s.url + f"/models/{name}/versions/{version}/predict",
                      json={"instances": x.tolist()}, timeout=T)
    assert r.status_code == 200, r.text
    return np.array(r.json()["predictions"], dtype=np.float32)


def expect_error(r, status, code=None):
    assert r.status_code == status, f"expected {status} {code}: {r.status_code} {r.text}"
    err = r.json()["error"]
    if code:
        assert err["code"] == code, r.text
    return err


def blobs(s):
    d = s.store / "blobs"
    return sorted(os.listdir(d)) if d.exists() else []


def versions(s, name):
    r = s.get(f"/models/{name}")
    return [v["version"] for v in r.json()["versions"]] if r.status_code == 200 else []


def save(tmp_path, name, obj):
    p = tmp_path / name
    torch.save(obj, p)
    return p


# ---------------------------------------------------------------- architecture

def test_architecture_put_get_answers_the_parameter_table(server):
    r = put_arch(server, "m", CK / "mlp_arch.pt")
    assert r.status_code == 200, r.text
    table = r.json()
    sha = hashlib.sha256((CK / "mlp_arch.pt").read_bytes()).hexdigest()
    assert table["sha256"] == sha
    assert [(p["name"], p["shape"], p["dtype"], p["kind"]) for p in table["parameters"]] == [
        ("fc1.weight", [8, 4], "F32", "parameter"), ("fc1.bias", [8], "F32", "parameter"),
        ("fc2.weight", [3, 8], "F32", "parameter"), ("fc2.bias", [3], "F32", "parameter")]
    assert server.get("/models/m/architecture").json() == table
    assert server.get("/models/m").json()["architecture"] == {"sha256": sha}
    assert sha in blobs(server)
    # multipart, with buffers (BatchNorm's running stats, num_batches_tracked)
    r = put_arch(server, "b", CK / "bn_arch.pt", multipart=True)
    assert r.status_code == 200, r.text
    kinds = {p["name"]: (p["kind"], p["dtype"]) for p in r.json()["parameters"]}
    assert kinds["bn.running_mean"] == ("buffer", "F32")
    assert kinds["bn.num_batches_tracked"] == ("buffer", "I64")


def test_architecture_must_be_torchscript(server):
    expect_error(put_arch(server, "m", CK / "mlp_sd.pt"), 422, "not_torchscript")
    expect_error(put_arch(server, "m", FIX / "not_a_model.pt"), 422)
    expect_error(server.get("/models/m/architecture"), 404)
    assert blobs(server) == []


def test_state_dict_without_architecture_says_how_to_put_one(server):
    err = expect_error(upload(server, "m", (CK / "mlp_sd.pt").read_bytes()), 422,
                       "no_architecture")
    assert "PUT /models/m/architecture" in err["message"], err
    # the command that does it, which works as shown (test_curl_T_puts_an_architecture)
    assert "curl -T arch.pt .../models/m/architecture" in err["message"], err
    assert blobs(server) == []
    # a model of TorchScript versions has none either
    assert upload(server, "ts", (FIX / "mlp.pt").read_bytes()).status_code == 201
    err = expect_error(server.get("/models/ts/architecture"), 404, "no_architecture")
    assert "curl -T arch.pt .../models/ts/architecture" in err["message"], err


def curl_T(s, path, file, *args):
    """What `curl -T FILE URL` answers: (HTTP status, body). curl sends a PUT
    with no Content-Type."""
    r = subprocess.run(["curl", "-sS", "-T", str(file), *args, "-w", "\n%{http_code}",
                        s.url + path], capture_output=True, text=True, timeout=T, check=True)
    body, status = r.stdout.rsplit("\n", 1)
    return int(status), body


def test_curl_T_puts_an_architecture(server):
    status, body = curl_T(server, "/models/m/architecture", CK / "mlp_arch.pt")
    assert status == 200, body
    sha = hashlib.sha256((CK / "mlp_arch.pt").read_bytes()).hexdigest()
    assert json.loads(body)["sha256"] == sha
    assert server.get("/models/m").json()["architecture"] == {"sha256": sha}
    # a wrong explicit Content-Type is still refused, and stores nothing
    status, body = curl_T(server, "/models/n/architecture", CK / "mlp_arch.pt",
                          "-H", "Content-Type: text/plain")
    assert status == 415, body
    assert json.loads(body)["error"]["code"] == "unsupported_media_type"
    expect_error(server.get("/models/n"), 404)
    assert blobs(server) == [sha]


def test_raw_version_upload_without_content_type(server):
    assert put_arch(server, "m", CK / "mlp_arch.pt").status_code == 200
    data = (CK / "mlp_sd.pt").read_bytes()
    # requests sends bytes with no Content-Type, as curl -X POST -T does
    req = requests.Request("POST", server.url + "/models/m/versions", data=data).prepare()
    assert "Content-Type" not in req.headers
    r = requests.Session().send(req, timeout=T)
    assert r.status_code == 201, r.text
    assert r.json()["format"] == "torch_save"
    r = requests.post(server.url + "/models/m/versions", data=data, timeout=T,
                      headers={"Content-Type": "text/plain"})
    expect_error(r, 415, "unsupported_media_type")
    assert versions(server, "m") == [1]


# ---------------------------------------------------------------- uploads

MLP_FILES = ["mlp_sd.pt", "mlp_sd_plain.pt", "mlp_epoch3.pt", "mlp_adam.pt", "mlp_sd_module.pt",
             "mlp_sd_f16.pt", "mlp_sd_f64.pt", "mlp_sd_views.pt", "mlp.safetensors",
             "mlp_bf16.safetensors"]


def test_every_state_dict_shape_predicts_like_pytorch(server):
    assert put_arch(server, "m", CK / "mlp_arch.pt").status_code == 200
    for i, name in enumerate(MLP_FILES):
        v = created(upload(server, "m", (CK / name).read_bytes(),
                           **({"config": MLP_CONFIG} if i == 0 else {})))
        assert v["format"] == ("safetensors" if name.endswith(".safetensors") else "torch_save")
        got = predict(server, "m", v["version"], MLP_INPUT)
        want = eager(MLP(), file_state(CK / name), MLP_INPUT)
        assert np.abs(got - want).max() <= 1e-5, (name, got, want)
    # the committed expected outputs agree (the weights of ../mlp.pt)
    assert np.abs(predict(server, "m", 1, MLP_INPUT) - np.load(FIX / "mlp_expected.npy")).max() \
        <= 1e-5


def test_conv_batchnorm_state_dict_and_safetensors(server):
    assert put_arch(server, "b", CK / "bn_arch.pt").status_code == 200
    for name in ("bn_sd.pt", "bn.safetensors"):
        v = created(upload(server, "b", (CK / name).read_bytes(), config=BN_CONFIG))
        got = predict(server, "b", v["version"], CNN_INPUT)
        assert np.abs(got - np.load(CK / "bn_expected.npy")).max() <= 1e-5, name


def test_top_level_numbers_become_metrics_unless_given(server):
    assert put_arch(server, "m", CK / "mlp_arch.pt").status_code == 200
    data = (CK / "mlp_epoch3.pt").read_bytes()
    assert created(upload(server, "m", data, config=MLP_CONFIG))["metrics"] == \
        {"epoch": 3, "loss": 0.25}
    assert created(upload(server, "m", data, metrics={"val_accuracy": 0.8}))["metrics"] == \
        {"val_accuracy": 0.8}


def test_strict_loading_lists_missing_unexpected_and_mismatched(server, tmp_path):
    assert put_arch(server, "m", CK / "mlp_arch.pt").status_code == 200
    err = expect_error(upload(server, "m", (CK / "bn_sd.pt").read_bytes(), config=MLP_CONFIG),
                       422, "state_dict_mismatch")
    assert "4 missing keys (fc1.weight" in err["message"], err
    assert "9 unexpected keys (conv.weight" in err["message"], err
    wide = MLP(hidden=16).state_dict()
    err = expect_error(upload(server, "m", save(tmp_path, "wide.pt", wide).read_bytes(),
                              config=MLP_CONFIG), 422, "state_dict_mismatch")
    assert "fc1.weight: checkpoint [16,4], architecture [8,4]" in err["message"], err
    partial = collections.OrderedDict(list(MLP().state_dict().items())[:3])
    err = expect_error(upload(server, "m", save(tmp_path, "part.pt", partial).read_bytes(),
                              config=MLP_CONFIG), 422, "state_dict_mismatch")
    assert "1 missing key (fc2.bias)" in err["message"], err
    assert versions(server, "m") == []
    assert blobs(server) == [hashlib.sha256((CK / "mlp_arch.pt").read_bytes()).hexdigest()]


@pytest.mark.parametrize("name,word", [("evil_os_system.pt", "os.system"),
                                       ("evil_posix_system.pt", "posix.system"),
                                       ("evil_eval.pt", "builtins.eval"),
                                       ("evil_inside_sd.pt", None),
                                       ("whole_model.pt", "__main__.MLP")])
def test_malicious_pickle_refused_nothing_run_nothing_stored(server, name, word):
    if os.path.exists(PWNED):
        os.unlink(PWNED)
    assert put_arch(server, "m", CK / "mlp_arch.pt").status_code == 200
    before = blobs(server)
    err = expect_error(upload(server, "m", (CK / name).read_bytes(), config=MLP_CONFIG), 422)
    if word:
        assert word in err["message"], err
    assert "not allowed" in err["message"], err
    assert not os.path.exists(PWNED), "code from the pickle ran"
    assert blobs(server) == before
    assert versions(server, "m") == []
    assert os.listdir(server.store / "tmp") == []


@pytest.mark.parametrize("name", ["truncated.pt", "truncated.safetensors", "oob_numel.pt",
                                  "oob_offset.pt", "oob_stride.pt", "oob_missing_record.pt",
                                  "bad_storage_type.pt", "zip_bomb.pt", "legacy.pt"])
def test_damaged_files_answer_422_and_store_nothing(server, name):
    assert put_arch(server, "m", CK / "mlp_arch.pt").status_code == 200
    before = blobs(server)
    err = expect_error(upload(server, "m", (CK / name).read_bytes(), config=MLP_CONFIG), 422)
    if name == "legacy.pt":
        assert err["code"] == "legacy_checkpoint"
        assert "_use_new_zipfile_serialization=True" in err["message"], err
    assert blobs(server) == before
    assert versions(server, "m") == []


def test_replacing_the_architecture_keeps_versions_loading_across_restart(start_server):
    s = start_server()
    assert put_arch(s, "m", CK / "mlp_arch.pt").status_code == 200
    v = created(upload(s, "m", (CK / "mlp_sd.pt").read_bytes(), config=MLP_CONFIG))
    arch_sha = v["arch_sha256"]
    # a new architecture (other shapes): existing versions keep theirs
    assert put_arch(s, "m", CK / "bn_arch.pt").status_code == 200
    assert arch_sha in blobs(s)
    assert s.stop() == 0, s.stderr
    s2 = start_server(store=s.store)
    want = np.load(FIX / "mlp_expected.npy")
    assert np.abs(predict(s2, "m", 1, MLP_INPUT) - want).max() <= 1e-5
    assert s2.get("/models/m/versions/1").json()["arch_sha256"] == arch_sha
    # the new one takes its own state_dicts
    created(upload(s2, "m", (CK / "bn_sd.pt").read_bytes(), config=BN_CONFIG))
    assert len(blobs(s2)) == 4


# ---------------------------------------------------------------- export

def test_download_is_named_after_the_stored_format(server, tmp_path):
    """GET .../checkpoint answers the stored file; its name says what opens it,
    so `curl -OJ` then torch.load / safetensors works on the file as named."""
    assert put_arch(server, "m", CK / "mlp_arch.pt").status_code == 200
    assert created(upload(server, "m", (CK / "mlp.safetensors").read_bytes()))["format"] == \
        "safetensors"
    assert created(upload(server, "m", (CK / "mlp_sd.pt").read_bytes()))["format"] == "torch_save"
    created(upload(server, "ts", (FIX / "mlp.pt").read_bytes()))
    for name, version, filename, data in [("m", 1, "m-v1.safetensors", CK / "mlp.safetensors"),
                                          ("m", 2, "m-v2.pt", CK / "mlp_sd.pt"),
                                          ("ts", 1, "ts-v1.pt", FIX / "mlp.pt")]:
        r = server.get(f"/models/{name}/versions/{version}/checkpoint")
        assert r.status_code == 200, r.text
        assert r.headers["Content-Disposition"] == f'attachment; filename="{filename}"'
        assert r.content == data.read_bytes()
    # the safetensors export of a torch.save version is named as safetensors too
    r = server.get("/models/m/versions/2/checkpoint?format=safetensors")
    assert r.headers["Content-Disposition"] == 'attachment; filename="m-v2.safetensors"'
    # and the file as named opens with what its extension says
    (tmp_path / "m-v2.pt").write_bytes(server.get("/models/m/versions/2/checkpoint").content)
    assert set(torch.load(tmp_path / "m-v2.pt")) >= {"fc1.weight", "fc2.bias"}


def test_export_round_trips_bit_for_bit(server):
    assert put_arch(server, "m", CK / "mlp_arch.pt").status_code == 200
    for name in ("mlp_sd.pt", "mlp_sd_module.pt", "mlp.safetensors"):
        v = created(upload(server, "m", (CK / name).read_bytes(), config=MLP_CONFIG))
        r = server.get(f"/models/m/versions/{v['version']}/checkpoint?format=safetensors")
        assert r.status_code == 200, r.text
        got, meta = read_safetensors(r.content)
        want = file_state(CK / name)
        assert list(got) == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
        for k, t in want.items():
            assert got[k].dtype == np.float32 and got[k].tobytes() == t.numpy().tobytes(), k
        assert meta["version"] == str(v["version"])
    # a TorchScript version exports its own parameters
    r = requests.post(server.url + "/models/ts/versions", files={
        "checkpoint": ("m.pt", (FIX / "mlp.pt").read_bytes()),
        "config": (None, json.dumps(MLP_CONFIG))}, timeout=T)
    assert r.status_code == 201, r.text
    got, _ = read_safetensors(server.get("/models/ts/versions/1/checkpoint?format=safetensors")
                              .content)
    ts = torch.jit.load(str(FIX / "mlp.pt"))
    for k, t in ts.state_dict().items():
        assert got[k].tobytes() == t.numpy().tobytes(), k
    # and the export loads back as a version: the same predictions
    back = requests.post(server.url + "/models/m/versions", files={
        "checkpoint": ("x.safetensors",
                       server.get("/models/m/versions/1/checkpoint?format=safetensors").content)},
        timeout=T)
    assert np.array_equal(predict(server, "m", created(back)["version"], MLP_INPUT),
                          predict(server, "m", 1, MLP_INPUT))
    expect_error(server.get("/models/m/versions/1/checkpoint?format=onnx"), 400, "invalid_format")


# ---------------------------------------------------------------- averaging

def test_average_equals_pytorch_average(server, tmp_path):
    assert put_arch(server, "m", CK / "mlp_arch.pt").status_code == 200
    states = []
    for seed in (1, 2, 3):
        torch.manual_seed(seed)
        sd = MLP().state_dict()
        states.append(sd)
        created(upload(server, "m", save(tmp_path, f"e{seed}.pt", sd).read_bytes(),
                       config=MLP_CONFIG, metrics={"epoch": seed}))
    w = [0.2, 0.3, 0.5]
    r = requests.post(server.url + "/models/m/versions", json={
        "average": {"versions": [1, 2, 3], "weights": w}, "metrics": {"val_accuracy": 0.9},
        "make_default": False}, timeout=T)
    v = created(r)
    assert v["version"] == 4 and v["format"] == "safetensors" and v["default"] is False
    assert v["metrics"] == {"val_accuracy": 0.9}
    assert v["metadata"]["average"]["versions"] == [1, 2, 3]
    assert np.allclose(v["metadata"]["average"]["weights"], w)
    avg = {k: sum(wi * s[k] for wi, s in zip(w, states)) for k in states[0]}
    want = eager(MLP(), avg, MLP_INPUT)
    assert np.abs(predict(server, "m", 4, MLP_INPUT) - want).max() <= 1e-5
    # equal weights by default; a TorchScript version of the architecture counts
    r = requests.post(server.url + "/models/m/versions", files={
        "checkpoint": ("m.pt", (FIX / "mlp.pt").read_bytes())}, timeout=T)
    ts_version = created(r)["version"]
    v = created(requests.post(server.url + "/models/m/versions",
                              json={"average": {"versions": [1, ts_version]}}, timeout=T))
    ts_state = torch.jit.load(str(FIX / "mlp.pt")).state_dict()
    avg = {k: (states[0][k] + ts_state[k]) / 2 for k in states[0]}
    assert np.abs(predict(server, "m", v["version"], MLP_INPUT) -
                  eager(MLP(), avg, MLP_INPUT)).max() <= 1e-5


def test_average_keeps_integer_buffers_of_the_last_version(server):
    assert put_arch(server, "b", CK / "bn_arch.pt").status_code == 200
    created(upload(server, "b", (CK / "bn_sd.pt").read_bytes(), config=BN_CONFIG))
    created(upload(server, "b", (CK / "bn.safetensors").read_bytes()))
    v = created(requests.post(server.url + "/models/b/versions",
                              json={"average": {"versions": [1, 2]}}, timeout=T))
    got, _ = read_safetensors(server.get(f"/models/b/versions/{v['version']}/checkpoint"
                                         "?format=safetensors").content)
    assert got["bn.num_batches_tracked"].dtype == np.int64
    assert int(got["bn.num_batches_tracked"]) == 3
    assert np.abs(predict(server, "b", v["version"], CNN_INPUT) -
                  np.load(CK / "bn_expected.npy")).max() <= 1e-5


def test_average_of_different_shapes_is_422_naming_the_tensor(server, tmp_path):
    assert put_arch(server, "m", CK / "mlp_arch.pt").status_code == 200
    created(upload(server, "m", (CK / "mlp_sd.pt").read_bytes(), config=MLP_CONFIG))
    wide = torch.jit.script(MLP(hidden=16))
    wide.save(str(tmp_path / "wide.pt"))
    created(upload(server, "m", (tmp_path / "wide.pt").read_bytes()))
    before = blobs(server)
    err = expect_error(requests.post(server.url + "/models/m/versions",
                                     json={"average": {"versions": [1, 2]}}, timeout=T), 422)
    assert "fc1.weight" in err["message"] and "[8,4]" in err["message"] and \
        "[16,4]" in err["message"], err
    expect_error(requests.post(server.url + "/models/m/versions",
                               json={"average": {"versions": [1, 9]}}, timeout=T), 422)
    expect_error(requests.post(server.url + "/models/m/versions",
                               json={"average": {"versions": [1], "weights": [1, 2]}},
                               timeout=T), 400)
    assert blobs(server) == before and versions(server, "m") == [1, 2]


# ---------------------------------------------------------------- promotion

def test_promotion_policy_worse_better_and_restart(start_server):
    s = start_server()
    assert put_arch(s, "m", CK / "mlp_arch.pt").status_code == 200
    data = (CK / "mlp_sd.pt").read_bytes()
    created(upload(s, "m", data, config=MLP_CONFIG, metrics={"val_accuracy": 0.80}))
    r = s.request("PATCH", "/models/m",
                  json={"promote": {"metric": "val_accuracy", "order": "desc"}})
    assert r.status_code == 200 and r.json()["promote"] == {"metric": "val_accuracy",
                                                            "order": "desc"}, r.text
    worse = created(upload(s, "m", data, metrics={"val_accuracy": 0.70}))
    assert worse["default"] is False and worse["promotion"]["promoted"] is False
    assert "does not beat" in worse["promotion"]["reason"]
    none = created(upload(s, "m", data))
    assert none["default"] is False and "no metrics.val_accuracy" in none["promotion"]["reason"]
    better = created(upload(s, "m", data, metrics={"val_accuracy": 0.90}))
    assert better["default"] is True and better["promotion"]["promoted"] is True
    assert s.get("/models/m").json()["default_version"] == better["version"]
    # an explicit make_default is the client's call, not the policy's
    forced = created(upload(s, "m", data, metrics={"val_accuracy": 0.1}, make_default="true"))
    assert forced["default"] is True and "promotion" not in forced
    assert s.request("PATCH", "/models/m", json={"default_version": better["version"]}) \
        .status_code == 200
    assert s.stop() == 0, s.stderr
    s2 = start_server(store=s.store)
    m = s2.get("/models/m").json()
    assert m["promote"] == {"metric": "val_accuracy", "order": "desc"}
    assert m["default_version"] == better["version"]
    r = requests.post(s2.url + "/models/m/predict", json={"instances": MLP_INPUT.tolist()},
                      timeout=T)
    assert r.status_code == 200 and r.json()["version"] == better["version"], r.text
    worse2 = created(upload(s2, "m", data, metrics={"val_accuracy": 0.85}))
    assert worse2["default"] is False
    # asc: lower is better; null clears
    assert s2.request("PATCH", "/models/m", json={"promote": {"metric": "val_accuracy",
                                                              "order": "asc"}}).status_code == 200
    assert created(upload(s2, "m", data, metrics={"val_accuracy": 0.5}))["default"] is True
    assert s2.request("PATCH", "/models/m", json={"promote": None}).json()["promote"] is None
    assert created(upload(s2, "m", data, metrics={"val_accuracy": 0.99}))["default"] is True
    expect_error(s2.request("PATCH", "/models/m", json={"promote": {"order": "desc"}}), 400,
                 "invalid_promote")


# ---------------------------------------------------------------- evaluation

def test_job_records_its_accuracy_on_the_version(start_server, tmp_path):
    s = start_server("--allowed-paths", str(tmp_path))
    assert put_arch(s, "m", CK / "mlp_arch.pt").status_code == 200
    created(upload(s, "m", (CK / "mlp_sd.pt").read_bytes(), config=MLP_CONFIG))
    v2 = created(upload(s, "m", (CK / "mlp_epoch3.pt").read_bytes(), make_default="false"))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 4)).astype(np.float32)
    pred = eager(MLP(), file_state(CK / "mlp_sd.pt"), x).argmax(1)
    y = pred.copy()
    y[:10] = (y[:10] + 1) % 3  # 30 of 40 right
    csv = tmp_path / "test.csv"
    csv.write_text("a,b,c,d,label\n" + "".join(
        ",".join(f"{v:.9g}" for v in row) + f",{int(c)}\n" for row, c in zip(x, y)))
    job = {"model": "m", "version": v2["version"], "record_metric": "test_accuracy",
           "input": {"path": str(csv), "format": "csv", "label": "label"},
           "output": {"path": str(tmp_path / "out.jsonl")}}
    r = requests.post(s.url + "/jobs", json=job, timeout=T)
    assert r.status_code in (201, 202), r.text
    jid = r.json()["id"]
    deadline = time.monotonic() + 120 * TSCALE
    while time.monotonic() < deadline:
        st = s.get(f"/jobs/{jid}").json()
        if st["status"] in ("succeeded", "failed", "cancelled"):
            break
        time.sleep(0.05)
    assert st["status"] == "succeeded", st
    metrics = s.get(f"/models/m/versions/{v2['version']}").json()["metrics"]
    assert metrics == {"epoch": 3, "loss": 0.25, "test_accuracy": 0.75}, metrics
    bad = dict(job, input={"path": str(csv), "format": "csv"},
               output={"path": str(tmp_path / "out2.jsonl")})
    expect_error(requests.post(s.url + "/jobs", json=bad, timeout=T), 400, "invalid_job")


# ---------------------------------------------------------------- review fixes (issue 12)

def test_average_of_torchscript_versions_needs_no_architecture(server, tmp_path):
    # no PUT /models/t/architecture: the first TorchScript source is the network
    nets = []
    for seed in (4, 5):
        torch.manual_seed(seed)
        net = torch.jit.script(MLP())
        net.save(str(tmp_path / f"ts{seed}.pt"))
        nets.append(net.state_dict())
        created(upload(server, "t", (tmp_path / f"ts{seed}.pt").read_bytes(),
                       config=MLP_CONFIG))
    assert server.get("/models/t/architecture").status_code == 404
    w = [0.25, 0.75]
    v = created(requests.post(server.url + "/models/t/versions", json={
        "average": {"versions": [1, 2], "weights": w}}, timeout=T))
    assert v["format"] == "safetensors"
    avg = {k: w[0] * nets[0][k] + w[1] * nets[1][k] for k in nets[0]}
    assert np.abs(predict(server, "t", v["version"], MLP_INPUT) -
                  eager(MLP(), avg, MLP_INPUT)).max() <= 1e-5


def test_average_weights_must_be_finite_with_a_finite_positive_sum(server):
    assert put_arch(server, "m", CK / "mlp_arch.pt").status_code == 200
    data = (CK / "mlp_sd.pt").read_bytes()
    created(upload(server, "m", data, config=MLP_CONFIG))
    created(upload(server, "m", data))
    before = blobs(server)

    def average(body):
        return requests.post(server.url + "/models/m/versions", json={"average": body},
                             timeout=T)
    # each weight finite, but the sum overflows: every weight would normalise to 0
    err = expect_error(average({"versions": [1, 2], "weights": [1e308, 1e308]}), 400,
                       "invalid_average")
    assert "weights sum" in err["message"], err
    err = expect_error(average({"versions": [1, 2], "weights": [0, 0]}), 400, "invalid_average")
    assert "sum to 0" in err["message"], err
    err = expect_error(average({"versions": [1, 2], "weights": [-1, 2]}), 400, "invalid_average")
    assert "weights[0]" in err["message"], err
    # a version listed twice is a weight in disguise
    err = expect_error(average({"versions": [1, 2, 1]}), 400, "invalid_average")
    assert "version 1 twice" in err["message"], err
    assert blobs(server) == before and versions(server, "m") == [1, 2]
    # scaled down, the same ratios are fine
    created(average({"versions": [1, 2], "weights": [1e300, 1e300]}))


def test_average_past_max_average_bytes_is_413(start_server):
    a, b = (CK / "mlp_sd.pt").read_bytes(), (CK / "mlp_epoch3.pt").read_bytes()
    s = start_server("--max-average-bytes", str(len(a) + len(b) - 1))
    assert put_arch(s, "m", CK / "mlp_arch.pt").status_code == 200
    created(upload(s, "m", a, config=MLP_CONFIG))
    created(upload(s, "m", b))
    before = blobs(s)
    err = expect_error(requests.post(s.url + "/models/m/versions",
                                     json={"average": {"versions": [1, 2]}}, timeout=T), 413,
                       "average_too_large")
    assert "max_average_bytes" in err["message"], err
    assert blobs(s) == before and versions(s, "m") == [1, 2]
    # one version is within the budget
    created(requests.post(s.url + "/models/m/versions",
                          json={"average": {"versions": [1]}}, timeout=T))


def test_metric_names_are_restricted(start_server, tmp_path):
    s = start_server("--allowed-paths", str(tmp_path))
    assert put_arch(s, "m", CK / "mlp_arch.pt").status_code == 200
    created(upload(s, "m", (CK / "mlp_sd.pt").read_bytes(), config=MLP_CONFIG))
    for bad in ('acc"uracy', "acc\\uracy", "a b", "x" * 65, ""):
        expect_error(s.request("PATCH", "/models/m", json={"promote": {"metric": bad}}), 400,
                     "invalid_promote")
    r = s.request("PATCH", "/models/m", json={"promote": {"metric": "top-1.acc_v2"}})
    assert r.status_code == 200, r.text
    csv = tmp_path / "test.csv"
    x = np.random.default_rng(1).normal(size=(6, 4)).astype(np.float32)
    csv.write_text("a,b,c,d,label\n" + "".join(
        ",".join(f"{v:.9g}" for v in row) + ",0\n" for row in x))
    job = {"model": "m", "version": 1, "input": {"path": str(csv), "format": "csv",
                                                 "label": "label"}}
    for i, bad in enumerate(('test"acc', "test\\acc", "x" * 65)):
        err = expect_error(requests.post(s.url + "/jobs", json=dict(
            job, record_metric=bad, output={"path": str(tmp_path / f"bad{i}.jsonl")}),
            timeout=T), 400, "invalid_job")
        assert "A-Z a-z 0-9" in err["message"], err
    r = requests.post(s.url + "/jobs", json=dict(
        job, record_metric="top-1.acc_v2", output={"path": str(tmp_path / "ok.jsonl")}),
        timeout=T)
    assert r.status_code in (201, 202), r.text
    import time
    jid = r.json()["id"]
    deadline = time.monotonic() + 120 * TSCALE
    while time.monotonic() < deadline:
        st = s.get(f"/jobs/{jid}").json()
        if st["status"] in ("succeeded", "failed", "cancelled"):
            break
        time.sleep(0.05)
    assert st["status"] == "succeeded", st
    metrics = s.get("/models/m/versions/1").json()["metrics"]
    assert set(metrics) == {"top-1.acc_v2"} and 0 <= metrics["top-1.acc_v2"] <= 1, metrics


def test_non_finite_and_huge_top_level_numbers(server, tmp_path):
    assert put_arch(server, "m", CK / "mlp_arch.pt").status_code == 200
    torch.manual_seed(0)
    p = save(tmp_path, "odd.pt", {"epoch": 3, "loss": float("nan"), "inf": float("inf"),
                                  "big": 1e300, "step": 2.0 ** 60, "model": MLP().state_dict()})
    v = created(upload(server, "m", p.read_bytes(), config=MLP_CONFIG))
    # NaN and inf are no JSON numbers: skipped; 1e300 and 2**60 stay reals
    m = v["metrics"]
    assert set(m) == {"epoch", "big", "step"} and m["epoch"] == 3 and \
        isinstance(m["epoch"], int), m
    assert m["big"] == pytest.approx(1e300) and m["step"] == pytest.approx(2.0 ** 60), m


def test_recorded_metric_goes_through_the_promotion_policy(start_server, tmp_path):
    """A job's record_metric of the policy's metric promotes the version it
    ran when it beats the default (or the default lacks the metric); a tie,
    a worse result or another metric leaves the default alone."""
    s = start_server("--allowed-paths", str(tmp_path), "--store-poll-ms", "0")
    assert put_arch(s, "m", CK / "mlp_arch.pt").status_code == 200
    assert s.request("PATCH", "/models/m", json={"promote": {"metric": "test_accuracy"}}) \
        .status_code == 200
    data = (CK / "mlp_sd.pt").read_bytes()
    for _ in range(3):
        created(upload(s, "m", data, config=MLP_CONFIG))
    assert s.get("/models/m").json()["default_version"] == 1
    x = np.random.default_rng(1).normal(size=(20, 4)).astype(np.float32)
    pred = eager(MLP(), file_state(CK / "mlp_sd.pt"), x).argmax(1)

    def job(version, wrong, metric="test_accuracy"):
        y = pred.copy()
        y[:wrong] = (y[:wrong] + 1) % 3
        csv = tmp_path / f"t{version}-{wrong}-{metric}.csv"
        csv.write_text("a,b,c,d,label\n" + "".join(
            ",".join(f"{v:.9g}" for v in row) + f",{int(c)}\n" for row, c in zip(x, y)))
        r = requests.post(s.url + "/jobs", json={
            "model": "m", "version": version, "record_metric": metric,
            "input": {"path": str(csv), "format": "csv", "label": "label"}}, timeout=T)
        assert r.status_code in (201, 202), r.text
        deadline = time.monotonic() + 120 * TSCALE
        while (st := s.get(f"/jobs/{r.json()['id']}").json())["status"] in ("queued", "running"):
            assert time.monotonic() < deadline, st
            time.sleep(0.05)
        assert st["status"] == "succeeded", st
        default = s.get("/models/m").json()["default_version"]
        # what serves /predict follows at once (no store polling here)
        r = requests.post(s.url + "/models/m/predict", json={"instances": x[:1].tolist()},
                          timeout=T)
        assert r.status_code == 200 and r.json()["version"] == default, r.text
        return default

    assert job(2, 5, metric="other") == 1      # not the policy's metric
    assert job(2, 10) == 2                     # default 1 had no test_accuracy: 0.5 wins
    assert job(3, 10) == 2                     # a tie is no win
    assert job(3, 15) == 2                     # 0.25 is worse
    assert job(1, 4) == 1                      # 0.8 beats 0.5
    assert job(1, 0) == 1                      # the default itself: stays
    assert s.request("PATCH", "/models/m", json={"promote": {"metric": "test_accuracy",
                                                             "order": "asc"}}).status_code == 200
    assert job(3, 18) == 3                     # asc: 0.1 < 1.0
    assert s.request("PATCH", "/models/m", json={"promote": None}).status_code == 200
    assert job(2, 20) == 3                     # no policy: recording only
    assert [v["metrics"].get("test_accuracy") for v in s.get("/models/m").json()["versions"]] == \
        [1.0, 0.0, 0.1]


def test_architecture_blob_collected_with_its_last_version(server):
    """An architecture replaced while versions still use it stays until the
    last of them goes, by delete or by retention; then it is collected at
    once, as a weights blob is, not at the next open."""
    arch_a = hashlib.sha256((CK / "mlp_arch.pt").read_bytes()).hexdigest()
    assert put_arch(server, "m", CK / "mlp_arch.pt").status_code == 200
    v1 = created(upload(server, "m", (CK / "mlp_sd.pt").read_bytes(), config=MLP_CONFIG))
    assert v1["arch_sha256"] == arch_a
    created(upload(server, "m", (CK / "mlp_sd_plain.pt").read_bytes()))
    assert put_arch(server, "m", CK / "bn_arch.pt").status_code == 200
    created(upload(server, "m", (CK / "bn_sd.pt").read_bytes(), config=BN_CONFIG,
                   make_default="true"))
    assert arch_a in blobs(server)
    r = server.request("DELETE", "/models/m/versions/1")
    assert r.status_code in (200, 204), r.text
    assert arch_a in blobs(server), "version 2 still uses the first architecture"
    r = server.request("PATCH", "/models/m", json={"retention": {"keep_last": 1}})
    assert r.status_code == 200, r.text
    assert versions(server, "m") == [3]
    assert arch_a not in blobs(server)
    bn_arch = hashlib.sha256((CK / "bn_arch.pt").read_bytes()).hexdigest()
    assert bn_arch in blobs(server)
    # a delete does it too (the model keeps its own architecture)
    assert put_arch(server, "n", CK / "mlp_arch.pt").status_code == 200
    created(upload(server, "n", (CK / "mlp_sd.pt").read_bytes(), config=MLP_CONFIG))
    assert put_arch(server, "n", CK / "bn_arch.pt").status_code == 200
    assert arch_a in blobs(server)
    r = server.request("DELETE", "/models/n/versions/1?force=true")
    assert r.status_code in (200, 204), r.text
    assert arch_a not in blobs(server) and bn_arch in blobs(server)
