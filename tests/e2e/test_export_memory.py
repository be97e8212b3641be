"""
test_export_memory.py - a safetensors export streams (issue 24,
amplification 6), against the real binary: a ~134 MB model (32 linears of
1024x1024, so one tensor is 4 MB) deployed as a state_dict into its
architecture, from a torch.save file, a safetensors file and a float16
torch.save file (converted to the architecture's float32 on the way out),
exports bit for bit what PyTorch holds while the server's peak RSS (VmHWM)
grows by less than 0.3x the model: the export used to hold the file, the
converted weights and the reply at once (1.85x).
"""
import collections
import json
import struct

import numpy as np
import pytest
import requests

from conftest import TSCALE
from memwatch import MB, PeakGrowth, wait_threads_gone

torch = pytest.importorskip("torch")
nn = torch.nn

LAYERS, WIDTH = 32, 1024
T = 300 * TSCALE


def make_net():
    torch.manual_seed(24)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])


def safetensors_bytes(state):
    header, blobs, at = {}, [], 0
    for name, t in state.items():
        raw = t.detach().contiguous().numpy().tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape),
                        "data_offsets": [at, at + len(raw)]}
        blobs.append(raw)
        at += len(raw)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + b"".join(blobs)


def read_safetensors(data):
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    meta = header.pop("__metadata__", {})
    out = collections.OrderedDict()
    for name, d in header.items():
        a, b = d["data_offsets"]
        assert d["dtype"] == "F32", d
        out[name] = np.frombuffer(data, dtype="<f4", count=(b - a) // 4,
                                  offset=8 + n + a).reshape(d["shape"])
    return out, meta


def torch_save_bytes(tmp_path, name, state):
    p = tmp_path / name
    torch.save(state, p)
    return p.read_bytes()


def test_export_streams_in_a_fraction_of_the_model(start_server, tmp_path):
    # nothing loads meanwhile: the versions are not deployed, and the store
    # sync (which would load a model's first version) does not run
    server = start_server("--store-poll-ms", "0")
    net = make_net()
    state = net.state_dict()
    model_bytes = sum(t.numel() * 4 for t in state.values())
    assert 120 * MB < model_bytes < 200 * MB
    arch = tmp_path / "arch.pt"
    torch.jit.script(net).save(str(arch))
    r = server.request("PUT", "/models/big/architecture", data=arch.read_bytes(),
                       headers={"Content-Type": "application/octet-stream"}, timeout=T)
    assert r.status_code == 200, r.text
    half = collections.OrderedDict((k, v.half()) for k, v in state.items())
    files = {"torch_save": torch_save_bytes(tmp_path, "sd.pt", state),
             "safetensors": safetensors_bytes(state),
             "float16": torch_save_bytes(tmp_path, "sd16.pt", half)}
    want = {k: v.numpy() for k, v in state.items()}
    want16 = {k: v.float().numpy() for k, v in half.items()}
    for kind, data in files.items():
        r = requests.post(server.url + "/models/big/versions", timeout=T,
                          files={"checkpoint": ("ckpt", data), "deploy": (None, "false")})
        assert r.status_code == 201, r.text
        version = r.json()["version"]
        # the upload's check loads the model; its workers let go of it on
        # their own threads after the answer
        wait_threads_gone(server.proc.pid, ("md-big", "mj-big", "md-deferred"), T)
        with PeakGrowth(server.proc.pid) as peak:
            r = server.get(f"/models/big/versions/{version}/checkpoint?format=safetensors",
                           timeout=T)
        assert r.status_code == 200, r.text
        got, meta = read_safetensors(r.content)
        assert meta["model"] == "big" and meta["version"] == str(version), meta
        assert list(got) == list(want), kind
        for name, a in got.items():
            np.testing.assert_array_equal(a, (want16 if kind == "float16" else want)[name],
                                          err_msg=f"{kind}: {name}")
        assert peak.bytes < 0.3 * model_bytes, \
            (f"{kind}: peak RSS grew {peak.bytes / MB:.0f} MB exporting a "
             f"{model_bytes / MB:.0f} MB model")
