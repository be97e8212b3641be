"""
test_training_fashion.py - issue 12 end to end with the FashionMNIST example:
examples/fashion_mnist/train.py --state-dicts trains 3 short epochs (--limit,
seconds on any machine) into tmp_path; the architecture is PUT, the three
epoch state_dicts pushed with their metrics under a promotion policy on
test_accuracy; a job over Debian's t10k IDX files evaluates each version with
record_metric; the last two are averaged and the average evaluated too. Every
recorded accuracy is PyTorch's on the same weights and the same 10,000 images,
the average predicts as PyTorch's average of the two state_dicts, and the best
version by test_accuracy is the default, also after a restart.

PyTorch runs in this process (the e2e suite runs under Debian's
/usr/bin/python3, which has python3-torch) on the very files the script wrote.
"""
import gzip
import json
import subprocess
import time

import numpy as np
import pytest
import requests

from conftest import REPO, TSCALE, child_env

torch = pytest.importorskip("torch")

EXAMPLE = REPO / "examples" / "fashion_mnist"
FMNIST = "/usr/share/datasets/fashion-mnist"
IMAGES = f"{FMNIST}/t10k-images-idx3-ubyte.gz"
LABELS = f"{FMNIST}/t10k-labels-idx1-ubyte.gz"
CONFIG = json.loads((EXAMPLE / "model.json").read_text())
EPOCHS = 3
LIMIT = 2000  # training images: enough that the epochs differ, seconds to train
T = 60 * TSCALE
JOB_DEADLINE = 600 * TSCALE  # generous: a slow or shared machine only waits longer
# A row on which the server's class may differ from PyTorch's without either
# being wrong: its two best logits are closer than float32 rounding between two
# BLAS code paths (batch sizes differ) can move them.
NEAR_TIE = 1e-4


def read_idx(path):
    with gzip.open(path, "rb") as f:
        data = f.read()
    ndim = data[3]
    dims = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


@pytest.fixture(scope="module")
def test_set():
    images = read_idx(IMAGES)
    labels = read_idx(LABELS).astype(np.int64)
    assert images.shape == (10000, 28, 28) and labels.shape == (10000,)
    pixels = images.reshape(10000, 784)
    return pixels, torch.from_numpy(pixels.astype(np.float32) / 255.0), torch.from_numpy(labels)


def train(tmp_path):
    out = tmp_path / "run"
    r = subprocess.run(["/usr/bin/python3", str(EXAMPLE / "train.py"), "--epochs", str(EPOCHS),
                        "--limit", str(LIMIT), "--state-dicts", "--out", str(out)],
                       cwd=str(tmp_path), env=child_env(), capture_output=True, text=True,
                       timeout=600 * TSCALE)
    assert r.returncode == 0, r.stderr
    want = ["arch.pt", "metrics.json", "model.json", "model.pt"] + \
        [f"epoch_{e}.{x}" for e in range(1, EPOCHS + 1) for x in ("json", "pt")]
    assert sorted(p.name for p in out.iterdir()) == sorted(want)
    return out


def logits(arch, state, x):
    """The architecture with `state` loaded strictly, as PyTorch runs it."""
    net = torch.jit.load(str(arch))
    net.load_state_dict(state)  # ScriptModule: strict like nn.Module
    net.eval()
    with torch.no_grad():
        return torch.cat([net(x[i:i + 1000]) for i in range(0, len(x), 1000)])


def created(r):
    assert r.status_code == 201, r.text
    return r.json()


def push(s, path, metrics):
    return created(requests.post(s.url + "/models/fm/versions", files={
        "checkpoint": (path.name, path.read_bytes()),
        "config": (None, json.dumps(CONFIG)),
        "metrics": (None, json.dumps(metrics))}, timeout=T))


def evaluate(s, version):
    """Run a test_accuracy job on `version`; returns (job, predicted class per row)."""
    r = requests.post(s.url + "/jobs", json={
        "model": "fm", "version": version, "record_metric": "test_accuracy",
        "input": {"path": IMAGES, "format": "idx", "label": LABELS}}, timeout=T)
    assert r.status_code in (201, 202), r.text
    jid = r.json()["id"]
    deadline = time.monotonic() + JOB_DEADLINE
    while True:
        job = s.get(f"/jobs/{jid}", timeout=T).json()
        if job["status"] not in ("queued", "running"):
            break
        assert time.monotonic() < deadline, f"job on version {version} not done: {job}"
        time.sleep(0.1)
    assert job["status"] == "succeeded", job
    rows = [json.loads(line) for line in s.get(f"/jobs/{jid}/output", timeout=T).text.splitlines()]
    assert [row["index"] for row in rows] == list(range(10000))
    return job, np.array([CONFIG["labels"].index(row["prediction"]) for row in rows])


def agrees_with_pytorch(job, served, want_logits, y):
    """The job's count is PyTorch's: the same class on every row, except rows
    whose two best logits tie within NEAR_TIE (named in the failure)."""
    ours = want_logits.argmax(1).numpy()
    top2 = torch.topk(want_logits, 2, dim=1).values
    gap = (top2[:, 0] - top2[:, 1]).numpy()
    differ = np.nonzero(served != ours)[0]
    assert all(gap[i] < NEAR_TIE for i in differ), \
        f"rows {differ[:10].tolist()} differ from PyTorch with gaps {gap[differ[:10]].tolist()}"
    correct = int((torch.from_numpy(served) == y).sum())
    assert job["correct"] == correct and job["rows_done"] == 10000, job
    pytorch_correct = int((want_logits.argmax(1) == y).sum())
    assert abs(correct - pytorch_correct) <= len(differ)
    return correct


def test_train_push_evaluate_average_promote(start_server, tmp_path, test_set):
    pixels, x, y = test_set
    run = train(tmp_path)
    arch = run / "arch.pt"
    states = [torch.load(run / f"epoch_{e}.pt") for e in range(1, EPOCHS + 1)]
    # no store polling: /predict must follow a promotion by itself, not by the
    # sync that looks for other replicas' changes
    s = start_server("--allowed-paths", f"{FMNIST},{tmp_path}", "--store-poll-ms", "0")

    r = s.request("PUT", "/models/fm/architecture", data=arch.read_bytes(),
                  headers={"Content-Type": "application/octet-stream"}, timeout=T)
    assert r.status_code == 200, r.text
    assert [(p["name"], p["shape"]) for p in r.json()["parameters"]] == \
        [(k, list(v.shape)) for k, v in states[0].items()]
    r = s.request("PATCH", "/models/fm",
                  json={"promote": {"metric": "test_accuracy", "order": "desc"}})
    assert r.status_code == 200, r.text

    # push every epoch with what the script measured: the first is the default
    # (there was none); the others lack test_accuracy, so they wait for a job
    for e in range(1, EPOCHS + 1):
        metrics = json.loads((run / f"epoch_{e}.json").read_text())
        assert metrics["epoch"] == e
        v = push(s, run / f"epoch_{e}.pt", metrics)
        assert v["version"] == e and v["format"] == "torch_save" and v["metrics"] == metrics
        assert v["default"] is (e == 1), v
        if e > 1:
            assert "no metrics.test_accuracy" in v["promotion"]["reason"], v

    # evaluate each epoch, the last first: the accuracy recorded is PyTorch's
    # on these weights, and the policy applies to it as to an upload (the
    # default lacking test_accuracy, the first result wins; then only a better)
    accuracy, default = {}, 1

    def expect_promotion(v):
        nonlocal default
        if v != default and (default not in accuracy or accuracy[v] > accuracy[default]):
            default = v
        assert s.get("/models/fm").json()["default_version"] == default, (v, accuracy)
        # and it serves /predict as soon as the job reads as succeeded
        r = requests.post(s.url + "/models/fm/predict", json={"instances": pixels[:1].tolist()},
                          timeout=T)
        assert r.status_code == 200 and r.json()["version"] == default, (v, r.text)

    for e in range(EPOCHS, 0, -1):
        job, served = evaluate(s, e)
        correct = agrees_with_pytorch(job, served, logits(arch, states[e - 1], x), y)
        accuracy[e] = correct / 10000
        metrics = s.get(f"/models/fm/versions/{e}").json()["metrics"]
        assert metrics["test_accuracy"] == pytest.approx(accuracy[e], abs=1e-12), metrics
        assert metrics["epoch"] == e  # the pushed metrics stay
        expect_promotion(e)
    assert len(set(accuracy.values())) > 1, f"the epochs should differ: {accuracy}"

    # average the last two: PyTorch's mean of the two state_dicts
    avg = created(requests.post(s.url + "/models/fm/versions",
                                json={"average": {"versions": [EPOCHS - 1, EPOCHS]}}, timeout=T))
    va = avg["version"]
    assert va == EPOCHS + 1 and avg["default"] is False, avg
    assert avg["metadata"]["average"] == {"versions": [EPOCHS - 1, EPOCHS], "weights": [0.5, 0.5]}
    mean = {k: (states[-2][k] + states[-1][k]) / 2 for k in states[-1]}
    rows = list(range(0, 10000, 625))  # 16 rows across the test set
    r = requests.post(s.url + f"/models/fm/versions/{va}/predict",
                      json={"instances": pixels[rows].tolist()}, timeout=T)
    assert r.status_code == 200, r.text
    got = np.array(r.json()["predictions"], dtype=np.float32)
    want = logits(arch, mean, x[rows]).numpy()
    assert np.abs(got - want).max() <= 1e-5, (got, want)
    job, served = evaluate(s, va)
    accuracy[va] = agrees_with_pytorch(job, served, logits(arch, mean, x), y) / 10000
    assert s.get(f"/models/fm/versions/{va}").json()["metrics"]["test_accuracy"] == \
        pytest.approx(accuracy[va], abs=1e-12)
    expect_promotion(va)

    # so the default is the best version by test_accuracy
    best = default
    assert accuracy[best] == max(accuracy.values()), accuracy
    listed = s.get("/models/fm/versions?order_by=metrics.test_accuracy&order=desc").json()
    assert listed["versions"][0]["metrics"]["test_accuracy"] == accuracy[best], listed

    # and across a restart: policy, metrics and default kept, /predict serves it
    assert s.stop() == 0, s.stderr
    s2 = start_server("--allowed-paths", f"{FMNIST},{tmp_path}", store=s.store)
    model = s2.get("/models/fm").json()
    assert model["default_version"] == best and model["promote"] == \
        {"metric": "test_accuracy", "order": "desc"}, model
    assert {v["version"]: v["metrics"]["test_accuracy"] for v in model["versions"]} == \
        pytest.approx(accuracy, abs=1e-12)
    r = requests.post(s2.url + "/models/fm/predict", json={"instances": pixels[:1].tolist()},
                      timeout=T)
    assert r.status_code == 200 and r.json()["version"] == best, r.text
