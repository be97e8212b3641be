#!/usr/bin/python3
"""
make.py - the binary classifier of README.md's "Binary and multi-label
classifiers": Linear(8, 1) + Sigmoid (the model of Ray Data's read_csv
example, on fewer features), trained on 200 rows made from a fixed seed, and
the CSV it is scored on (8 feature columns and a 0/1 `target`).

Writes, next to this file: model.pt (TorchScript), model.json (its config),
data.csv, and metrics.json with PyTorch's own accuracy,
((p > 0.5) == y).float().mean(), the number a modeld job must report.

    /usr/bin/python3 examples/binary/make.py
"""
import csv
import json
import os

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROWS, FEATURES = 200, 8


def main():
    torch.manual_seed(0)
    g = np.random.default_rng(29)
    x = g.normal(size=(ROWS, FEATURES)).astype(np.float32)
    w = g.normal(size=FEATURES).astype(np.float32)
    y = ((x @ w + g.normal(scale=1.5, size=ROWS)) > 1.0).astype(np.int64)
    X, Y = torch.from_numpy(x), torch.from_numpy(y).float()
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 1), torch.nn.Sigmoid())
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(300):
        opt.zero_grad()
        torch.nn.functional.binary_cross_entropy(model(X).squeeze(1), Y).backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        p = model(X).squeeze(1)
    # another CPU rounds the last bits differently: keep every row off the line
    assert (p - 0.5).abs().min().item() > 1e-3, "a row sits on the threshold: change the seed"
    accuracy = ((p > 0.5).long() == torch.from_numpy(y)).float().mean().item()
    torch.jit.script(model).save(os.path.join(HERE, "model.pt"))
    with open(os.path.join(HERE, "data.csv"), "w", newline="") as f:
        out = csv.writer(f, lineterminator="\n")
        out.writerow([f"f{i}" for i in range(FEATURES)] + ["target"])
        for row, label in zip(x, y):
            out.writerow([repr(float(v)) for v in row] + [int(label)])
    config = {"input": {"shape": [FEATURES]}, "output": "probabilities",
              "labels": ["negative", "positive"]}
    with open(os.path.join(HERE, "model.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    with open(os.path.join(HERE, "metrics.json"), "w") as f:
        json.dump({"accuracy": round(accuracy, 6), "correct": int(round(accuracy * ROWS)),
                   "rows": ROWS, "share_of_label_0": float((y == 0).mean())}, f)
        f.write("\n")
    print(f"accuracy {accuracy:.4f} (label 0 is {float((y == 0).mean()):.4f} of the rows)")


if __name__ == "__main__":
    main()
