"""
test_classes.py - how an output row reads as classes (issue 29), end to end,
against PyTorch's own arithmetic.

The model is the one of Ray Data's read_csv example: Linear(30, 1) + Sigmoid
over a 569-row CSV of 30 features and a 0/1 `target` column (the breast
cancer set's shape; the rows here are made from a fixed seed, since no
Debian package ships that set). A one-column output is a binary classifier:
class 1 when p > 0.5 for output "probabilities", when the logit > 0 for
"logits", or past a declared threshold. The job's accuracy must be PyTorch's
((p > 0.5) == y).mean() exactly, never the share of label 0 that an argmax
over one column gives; a one-column output of undeclared meaning gets no
accuracy and a reason. Online labels, scores and top_k follow the same rule,
and a multi-label output (independent sigmoids) is declarable.

The models are built and scripted here with /usr/bin/python3's torch (the
Debian python3-torch); the server never runs Python.
"""
import csv
import io
import json
import subprocess
import time

import numpy as np
import pytest
import requests

from conftest import TSCALE

ROWS, FEATURES = 569, 30
JOB_TIMEOUT = 60.0

MAKE_MODELS = r"""
import sys, numpy as np, torch
out = sys.argv[1]
torch.manual_seed(0)
g = np.random.default_rng(7)
ROWS, FEATURES = 569, 30
x = g.normal(size=(ROWS, FEATURES)).astype(np.float32)
w = g.normal(size=FEATURES).astype(np.float32)
# labels from a noisy linear rule, about 37 % of them 1 (as the cancer set's)
y = ((x @ w + g.normal(scale=2.0, size=ROWS)) > 1.5).astype(np.int64)
np.save(out + "/x.npy", x)
np.save(out + "/y.npy", y)
X, Y = torch.from_numpy(x), torch.from_numpy(y).float()
lin = torch.nn.Linear(FEATURES, 1)
opt = torch.optim.SGD(lin.parameters(), lr=0.1)
for _ in range(200):
    opt.zero_grad()
    loss = torch.nn.functional.binary_cross_entropy_with_logits(lin(X).squeeze(1), Y)
    loss.backward()
    opt.step()
lin.eval()
sig = torch.nn.Sequential(lin, torch.nn.Sigmoid()).eval()
torch.jit.script(sig).save(out + "/sigmoid.pt")
torch.jit.script(lin).save(out + "/logit.pt")
three = torch.nn.Sequential(torch.nn.Linear(FEATURES, 3), torch.nn.Sigmoid()).eval()
torch.jit.script(three).save(out + "/multi.pt")
with torch.no_grad():
    np.save(out + "/p.npy", sig(X).squeeze(1).numpy())
    np.save(out + "/logit.npy", lin(X).squeeze(1).numpy())
    np.save(out + "/multi.npy", three(X).numpy())
"""


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("classes")
    subprocess.run(["/usr/bin/python3", "-c", MAKE_MODELS, str(d)], check=True, timeout=300)
    x, y = np.load(d / "x.npy"), np.load(d / "y.npy")
    names = [f"f{i}" for i in range(FEATURES)]
    with open(d / "cancer.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(names + ["target"])
        for row, label in zip(x, y):
            w.writerow([repr(float(v)) for v in row] + [int(label)])
    ns = type("Data", (), {})()
    ns.dir, ns.x, ns.y, ns.names = d, x, y, names
    ns.p, ns.logit, ns.multi = np.load(d / "p.npy"), np.load(d / "logit.npy"), np.load(d / "multi.npy")
    # the server's forward may differ from this one in the last bits (another
    # batch size, another BLAS kernel): no row may sit on a decision boundary
    assert np.abs(ns.logit).min() > 1e-3 and np.abs(ns.p - 0.3).min() > 1e-4, \
        "a fixture row sits on a threshold: change the seed"
    assert np.abs(ns.multi - 0.5).min() > 1e-4, "a fixture row sits on a threshold"
    return ns


@pytest.fixture
def srv(start_server, data):
    return start_server("--allowed-paths", str(data.dir))


def deploy(srv, name, model, config, status=201):
    with open(model, "rb") as f:
        r = requests.post(srv.url + f"/models/{name}/versions", files={"checkpoint": f},
                          data={"config": json.dumps(config)}, timeout=60 * TSCALE)
    assert r.status_code == status, f"deploy {name} {config}: {r.status_code} {r.text}"
    return r.json()


def run_job(srv, spec):
    r = srv.request("POST", "/jobs", json=spec, timeout=10 * TSCALE)
    assert r.status_code == 202, r.text
    jid = r.json()["id"]
    deadline = time.monotonic() + JOB_TIMEOUT * TSCALE
    while True:
        job = srv.get(f"/jobs/{jid}").json()
        if job["status"] in ("succeeded", "failed", "cancelled"):
            break
        assert time.monotonic() < deadline, f"job {jid} still {job['status']}"
        time.sleep(0.05)
    assert job["status"] == "succeeded", f"{job}\n{srv.stderr[-2000:]}"
    out = srv.get(f"/jobs/{jid}/output")
    assert out.status_code == 200, out.text
    return job, out.text


def csv_job(data, model, **extra):
    spec = {"model": model, "input": {"path": str(data.dir / "cancer.csv"), "format": "csv",
                                      "label": "target"}}
    spec.update(extra)
    return spec


def rows(text):
    return [json.loads(line) for line in text.splitlines()]


CFG = {"input": {"shape": [FEATURES]}}


@pytest.mark.parametrize("kind", ["probabilities", "logits"])
def test_binary_job_accuracy_is_pytorchs(srv, data, kind):
    """The major bug: a 1-wide output was argmax'ed (always class 0)."""
    model = data.dir / ("sigmoid.pt" if kind == "probabilities" else "logit.pt")
    # the case exactly (no labels), and one with class names
    names = None if kind == "probabilities" else ["benign", "malignant"]
    deploy(srv, "cancer", model, {**CFG, "output": kind, **({"labels": names} if names else {})})
    pred = (data.p > 0.5).astype(np.int64) if kind == "probabilities" else \
        (data.logit > 0).astype(np.int64)
    correct = int((pred == data.y).sum())
    share0 = float((data.y == 0).mean())
    assert abs(correct / ROWS - share0) > 0.1, "the fixture model must beat the share of label 0"
    job, text = run_job(srv, csv_job(data, "cancer", record_metric="test_accuracy"))
    assert job["labeled"] == ROWS and job["correct"] == correct, job
    assert job["accuracy"] == pytest.approx(correct / ROWS, abs=1e-12), job
    assert job.get("accuracy_note") is None, job
    conf = np.zeros((2, 2), dtype=np.int64)
    for t, q in zip(data.y, pred):
        conf[t, q] += 1
    assert job["confusion"] == conf.tolist(), job
    out = rows(text)
    assert [r["prediction"] for r in out] == [names[q] if names else int(q) for q in pred]
    assert [r["label"] for r in out] == data.y.tolist()
    v = srv.get("/models/cancer/versions/1").json()
    assert v["metrics"]["test_accuracy"] == pytest.approx(correct / ROWS, abs=1e-12), v


def test_binary_job_declared_threshold_and_scores(srv, data):
    deploy(srv, "cancer", data.dir / "sigmoid.pt",
           {**CFG, "output": "probabilities", "threshold": 0.3})
    pred = (data.p > 0.3).astype(np.int64)
    job, text = run_job(srv, csv_job(data, "cancer", output={"include": ["prediction", "scores"]},
                                     top_k=2))
    assert job["correct"] == int((pred == data.y).sum()), job
    out = rows(text)
    # no labels declared: classes by index; top_k=2 is the decided class, then the other
    assert [r["prediction"] for r in out] == [[int(q), 1 - int(q)] for q in pred]
    for r, p in zip(out, data.p):
        assert r["scores"] == pytest.approx([1 - float(p), float(p)], rel=1e-5, abs=1e-6), r


def test_one_column_of_undeclared_meaning_gets_no_accuracy(srv, data):
    deploy(srv, "cancer", data.dir / "sigmoid.pt", CFG)
    job, text = run_job(srv, csv_job(data, "cancer", record_metric="test_accuracy"))
    assert job["accuracy"] is None and job["labeled"] == 0, job
    assert "output" in job["accuracy_note"] and "probabilities" in job["accuracy_note"], job
    v = srv.get("/models/cancer/versions/1").json()
    assert "test_accuracy" not in (v.get("metrics") or {}), v
    assert "not recorded" in srv.stderr, srv.stderr[-2000:]
    # the output still holds every row's value as it is
    out = rows(text)
    assert len(out) == ROWS
    assert [r["prediction"][0] for r in out] == pytest.approx(data.p.tolist(), rel=1e-5)
    # online: top_k needs classes
    r = srv.request("POST", "/models/cancer/predict?top_k=1", json=[data.x[0].tolist()])
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "no_classes" and "output" in r.json()["error"]["message"]
    r = srv.request("POST", "/models/cancer/predict", json=[data.x[0].tolist()])
    assert r.status_code == 200 and "labels" not in r.json(), r.text


def test_binary_online_labels_scores_and_top_k(srv, data):
    deploy(srv, "cancer", data.dir / "logit.pt",
           {**CFG, "output": "logits", "labels": ["benign", "malignant"]})
    x = data.x[:8]
    r = srv.request("POST", "/models/cancer/predict", json=x.tolist())
    assert r.status_code == 200, r.text
    body = r.json()
    want = ["malignant" if z > 0 else "benign" for z in data.logit[:8]]
    assert [l[0] for l in body["labels"]] == want, body
    p1 = 1 / (1 + np.exp(-data.logit[:8].astype(np.float64)))
    for s, q, lab in zip(body["scores"], p1, want):
        assert s[0] == pytest.approx(q if lab == "malignant" else 1 - q, rel=1e-5), body
    r = srv.request("POST", "/models/cancer/predict?top_k=5", json=x[:1].tolist())
    body = r.json()
    assert body["labels"][0] == [want[0], ["benign", "malignant"][want[0] == "benign"]], body
    assert sum(body["scores"][0]) == pytest.approx(1.0, rel=1e-6), body
    # KServe V1 and V2 answers are the raw output, as before
    r = srv.request("POST", "/v2/models/cancer/infer", json={"inputs": [
        {"name": "x", "shape": [1, FEATURES], "datatype": "FP32", "data": x[0].tolist()}]})
    assert r.json()["outputs"][0]["data"] == pytest.approx([float(data.logit[0])], rel=1e-5)


def test_multi_label_online_and_job(srv, data):
    names = ["a", "b", "c"]
    deploy(srv, "tags", data.dir / "multi.pt",
           {**CFG, "output": "probabilities", "multi_label": True, "threshold": 0.5,
            "labels": names})
    x = data.x[:16]
    body = srv.request("POST", "/models/tags/predict", json=x.tolist()).json()
    for got, scores, p in zip(body["labels"], body["scores"], data.multi[:16]):
        order = [j for j in np.argsort(-p, kind="stable") if p[j] > 0.5]
        assert got == [names[j] for j in order], (got, p)
        assert scores == pytest.approx([float(p[j]) for j in order], rel=1e-5)
    body = srv.request("POST", "/models/tags/predict?top_k=2", json=x[:1].tolist()).json()
    assert body["labels"][0] == [names[j] for j in np.argsort(-data.multi[0], kind="stable")[:2]]
    job, text = run_job(srv, csv_job(data, "tags"))
    assert job["accuracy"] is None and "multi-label" in job["accuracy_note"], job
    out = rows(text)
    for r, p in zip(out, data.multi):
        assert r["prediction"] == [names[j] for j in np.argsort(-p, kind="stable") if p[j] > 0.5]


@pytest.mark.parametrize("config,model,needle", [
    ({"labels": ["benign", "malignant"]}, "sigmoid.pt", "declare \"output\""),
    ({"output": "probabilities", "labels": ["malignant"]}, "sigmoid.pt", "give two"),
    ({"threshold": 0.3}, "sigmoid.pt", "declare \"output\""),
    ({"output": "probabilities", "threshold": 1.5}, "sigmoid.pt", "between 0 and 1"),
    ({"output": "raw", "multi_label": True}, "multi.pt", "probabilities"),
    ({"output": "probabilities", "multi_label": "yes"}, "multi.pt", "true"),
])
def test_deploy_refuses_a_rule_that_cannot_apply(srv, data, config, model, needle):
    body = deploy(srv, "bad", data.dir / model, {**CFG, **config}, status=422)
    assert body["error"]["code"] == "invalid_config", body
    assert needle in body["error"]["message"], body
    assert srv.get("/models/bad").status_code == 404
