#!/usr/bin/python3
"""Train the PyTorch quickstart NeuralNetwork on FashionMNIST and export it.

Uses the IDX files from Debian's dataset-fashion-mnist package (read here with
gzip + numpy; torchvision is not needed). Writes into --out DIR (default: a new
temporary directory; the path is printed), never anywhere else:

  model.pt      TorchScript model; input float32 [N,784] or [N,1,28,28]
                (pixels scaled to [0,1]), output logits [N,10]
  model.json    serving config (input shape, preprocessing, labels)
  metrics.json  {"epoch", "loss", "accuracy"} of the final epoch, where loss
                is the mean cross-entropy on the test set and accuracy the
                test-set accuracy as a fraction

With --state-dicts, also what a training loop pushes to modeld as versions of
one architecture (README.md, "From a training run"):

  arch.pt       TorchScript of the untrained network: the architecture (its
                weights do not matter), for PUT /models/NAME/architecture
  epoch_N.pt    torch.save(model.state_dict()) after epoch N
  epoch_N.json  {"epoch", "loss", "accuracy"} of epoch N, as metrics.json

Usage:
    /usr/bin/python3 examples/fashion_mnist/train.py [--epochs 3] [--out DIR]
    /usr/bin/python3 examples/fashion_mnist/train.py --epochs 1 --limit 256   # a quick check
    /usr/bin/python3 examples/fashion_mnist/train.py --state-dicts --out DIR  # + epoch_N.pt
"""
import argparse
import copy
import gzip
import json
import os
import tempfile
import time

# Keep CPU use modest: one BLAS/OpenMP thread unless the caller says otherwise.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np
import torch
from torch import nn

DEFAULT_DATA = "/usr/share/datasets/fashion-mnist"

LABELS = [
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
    "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
]


class NeuralNetwork(nn.Module):
    """The network of the PyTorch quickstart tutorial.

    nn.Flatten flattens from dim 1, so [N,1,28,28] and [N,784] both work.
    """

    def __init__(self):
        super().__init__()
        self.flatten = nn.Flatten()
        self.linear_relu_stack = nn.Sequential(
            nn.Linear(28 * 28, 512),
            nn.ReLU(),
            nn.Linear(512, 512),
            nn.ReLU(),
            nn.Linear(512, 10),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.flatten(x)
        return self.linear_relu_stack(x)


def read_idx(path):
    """Read a gzipped IDX file (big-endian header) into a uint8 array."""
    with gzip.open(path, "rb") as f:
        data = f.read()
    magic = int.from_bytes(data[0:4], "big")
    if magic >> 8 != 0x08:  # 0x08 = unsigned byte
        raise ValueError(f"{path}: unsupported IDX type, magic {magic:#x}")
    ndim = magic & 0xFF
    dims = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim)]
    arr = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim)
    return arr.reshape(dims)


def load_split(data_dir, split, limit=0):
    """split is 'train' or 't10k'; the first `limit` examples (0 = all).
    Returns (float32 [N,1,28,28] in [0,1], int64 [N])."""
    images = read_idx(os.path.join(data_dir, f"{split}-images-idx3-ubyte.gz"))
    labels = read_idx(os.path.join(data_dir, f"{split}-labels-idx1-ubyte.gz"))
    if limit:
        images, labels = images[:limit], labels[:limit]
    # ToTensor semantics: uint8 / 255.
    x = torch.from_numpy(images.astype(np.float32) / 255.0).unsqueeze(1)
    y = torch.from_numpy(labels.astype(np.int64))
    return x, y


def evaluate(model, x, y, loss_fn, batch_size=1000):
    model.eval()
    total_loss, correct = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(x), batch_size):
            logits = model(x[i:i + batch_size])
            yb = y[i:i + batch_size]
            total_loss += loss_fn(logits, yb).item() * len(yb)
            correct += (logits.argmax(1) == yb).sum().item()
    return total_loss / len(x), correct / len(x)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--limit", type=int, default=0,
                    help="use only the first N training and test images (0 = all)")
    ap.add_argument("--data", default=DEFAULT_DATA)
    ap.add_argument("--state-dicts", action="store_true",
                    help="also write arch.pt, and epoch_N.pt (the state_dict) and "
                         "epoch_N.json (its metrics) after every epoch")
    ap.add_argument("--out", help="directory to write model.pt, model.json, metrics.json "
                                  "(default: a new temporary directory)")
    args = ap.parse_args()

    out = args.out or tempfile.mkdtemp(prefix="fashion_mnist-")
    os.makedirs(out, exist_ok=True)
    model_path = os.path.join(out, "model.pt")
    config_path = os.path.join(out, "model.json")
    metrics_path = os.path.join(out, "metrics.json")

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    x_train, y_train = load_split(args.data, "train", args.limit)
    x_test, y_test = load_split(args.data, "t10k", args.limit)
    print(f"train {tuple(x_train.shape)}  test {tuple(x_test.shape)}", flush=True)

    model = NeuralNetwork()
    if args.state_dicts:
        # The structure only: modeld loads every epoch's state_dict into it. A
        # copy of the untrained model, so the seeded RNG and training are as
        # without --state-dicts.
        torch.jit.script(copy.deepcopy(model)).save(os.path.join(out, "arch.pt"))
    loss_fn = nn.CrossEntropyLoss()
    # The quickstart's SGD(lr=1e-3) needs many epochs; Adam converges in a few.
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(args.seed)

    start = time.time()
    test_loss, acc = float("nan"), 0.0
    for epoch in range(1, args.epochs + 1):
        model.train()
        perm = torch.randperm(len(x_train), generator=gen)
        running, seen = 0.0, 0
        for i in range(0, len(perm), args.batch_size):
            idx = perm[i:i + args.batch_size]
            xb, yb = x_train[idx], y_train[idx]
            loss = loss_fn(model(xb), yb)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            running += loss.item() * len(idx)
            seen += len(idx)
        test_loss, acc = evaluate(model, x_test, y_test, loss_fn)
        print(f"epoch {epoch}: train loss {running / seen:.4f}  "
              f"test loss {test_loss:.4f}  test accuracy {acc:.4f}  "
              f"({time.time() - start:.0f}s)", flush=True)
        if args.state_dicts:
            torch.save(model.state_dict(), os.path.join(out, f"epoch_{epoch}.pt"))
            with open(os.path.join(out, f"epoch_{epoch}.json"), "w") as f:
                json.dump({"epoch": epoch, "loss": round(test_loss, 6),
                           "accuracy": round(acc, 6)}, f)
                f.write("\n")

    model.eval()
    scripted = torch.jit.script(model)
    # Sanity: the scripted model accepts both input layouts.
    with torch.no_grad():
        a = scripted(x_test[:4])
        b = scripted(x_test[:4].reshape(4, 784))
    assert torch.equal(a, b) and a.shape == (4, 10)
    scripted.save(model_path)

    config = {
        "input": {"shape": [784], "dtype": "float32"},
        "preprocess": {"scale": 1.0 / 255.0},
        "output": "logits",
        "labels": LABELS,
    }
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    metrics = {"epoch": args.epochs, "loss": round(test_loss, 6),
               "accuracy": round(acc, 6)}
    with open(metrics_path, "w") as f:
        json.dump(metrics, f)
        f.write("\n")
    print(f"wrote model.pt ({os.path.getsize(model_path)} bytes), model.json, "
          f"metrics.json to {out}")
    print(json.dumps(metrics))


if __name__ == "__main__":
    main()
