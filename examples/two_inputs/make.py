#!/usr/bin/python3
"""
make.py - the two-input model of README.md's "Models with several inputs and
outputs": a tabular classifier whose forward takes float features and an
int64 category (a city id, through nn.Embedding) and returns a tuple, the
class logits and the hidden embedding. Trained for a few hundred steps on
rows made from a fixed seed.

Writes, next to this file: model.pt (TorchScript), model.json (its config,
declaring both inputs and both outputs), data.csv (4 feature columns,
`city_id` and a `label` in 0..2) and metrics.json with PyTorch's own
accuracy over data.csv, the number a modeld job must report.

    /usr/bin/python3 examples/two_inputs/make.py
"""
import csv
import json
import os
from typing import Tuple

import numpy as np
import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
ROWS, CITIES = 300, 10


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.city = nn.Embedding(CITIES, 3)
        self.hidden = nn.Linear(4 + 3, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, numeric: torch.Tensor,
                city_id: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        h = torch.relu(self.hidden(torch.cat([numeric, self.city(city_id)], dim=1)))
        return self.head(h), h


def main():
    torch.manual_seed(0)
    g = np.random.default_rng(27)
    x = g.normal(size=(ROWS, 4)).astype(np.float32)
    city = g.integers(0, CITIES, size=ROWS).astype(np.int64)
    score = x[:, 0] - x[:, 1] + (city % 3) - 1.0 + g.normal(scale=0.6, size=ROWS)
    y = np.digitize(score, [-0.7, 0.7]).astype(np.int64)
    model = TwoInputs()
    opt = torch.optim.Adam(model.parameters(), lr=0.03)
    xt, ct, yt = torch.from_numpy(x), torch.from_numpy(city), torch.from_numpy(y)
    for _ in range(300):
        opt.zero_grad()
        logits, _ = model(xt, ct)
        nn.functional.cross_entropy(logits, yt).backward()
        opt.step()
    model.eval()
    scripted = torch.jit.script(model)
    scripted.save(os.path.join(HERE, "model.pt"))
    with open(os.path.join(HERE, "data.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["age", "bmi", "bp", "chol", "city_id", "label"])
        for i in range(ROWS):
            w.writerow([f"{v:.6f}" for v in x[i]] + [int(city[i]), int(y[i])])
    # scored on the CSV as written (what a job reads), float32 as modeld reads it
    with open(os.path.join(HERE, "data.csv")) as f:
        rows = list(csv.DictReader(f))
    xs = torch.tensor([[float(r[k]) for k in ("age", "bmi", "bp", "chol")] for r in rows])
    cs = torch.tensor([int(r["city_id"]) for r in rows])
    with torch.no_grad():
        logits, _ = scripted(xs, cs)
    correct = int((logits.argmax(1) == yt).sum())
    config = {
        "inputs": [{"name": "numeric", "shape": [4]},
                   {"name": "city_id", "shape": [], "dtype": "int64"}],
        "outputs": [{"name": "logits", "logits": True, "shape": [3]},
                    {"name": "hidden", "shape": [8]}],
        "labels": ["low", "mid", "high"],
    }
    with open(os.path.join(HERE, "model.json"), "w") as f:
        json.dump(config, f)
        f.write("\n")
    with open(os.path.join(HERE, "metrics.json"), "w") as f:
        json.dump({"rows": ROWS, "correct": correct, "accuracy": correct / ROWS}, f)
        f.write("\n")
    print(json.dumps({"rows": ROWS, "correct": correct}))


if __name__ == "__main__":
    main()
