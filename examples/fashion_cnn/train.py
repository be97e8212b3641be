#!/usr/bin/python3
"""Train the small CNN of the PyTorch CIFAR10 / Ray Train tutorial on FashionMNIST.

The network is the tutorial's `Net` (conv 5x5 -> max-pool -> conv 5x5 ->
max-pool -> three linear layers) adapted to 1x28x28 grey images: conv1 takes 1
channel instead of 3, and fc1 takes 16*4*4 features instead of 16*5*5. Inputs
are normalized as the tutorial's transforms.Normalize(0.5, 0.5) does after
ToTensor: x = (pixel / 255 - 0.5) / 0.5.

The data come from the IDX files of Debian's dataset-fashion-mnist package,
read with gzip + numpy (no torchvision, no download). Writes into --out DIR
(default: a new temporary directory; the path is printed), never anywhere else:

  model.pt      TorchScript; input float32 [N,1,28,28] normalized as above,
                output logits [N,10]
  model.json    serving config: input shape [1,28,28], preprocess
                scale 1/255, mean [0.5], std [0.5] (so clients send raw
                0..255 pixels), output logits, the 10 class labels
  metrics.json  {"epoch", "loss", "test_accuracy"}: mean cross-entropy and
                accuracy (a fraction) on the test set after the last epoch

Usage:
    /usr/bin/python3 examples/fashion_cnn/train.py [--epochs 2] [--out DIR]
    /usr/bin/python3 examples/fashion_cnn/train.py --epochs 1 --limit 256   # a quick check
"""
import argparse
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
import torch.nn.functional as F
from torch import nn

DEFAULT_DATA = "/usr/share/datasets/fashion-mnist"

LABELS = [
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
    "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
]

# What the server does to each raw pixel before the forward (model.json), in
# float32 as it does: x * scale, then (x - mean) / std.
SCALE, MEAN, STD = 1.0 / 255.0, 0.5, 0.5


class Net(nn.Module):
    """The CIFAR10 tutorial's Net for 1x28x28 inputs."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 6, 5)        # 28x28 -> 24x24
        self.pool = nn.MaxPool2d(2, 2)         # -> 12x12, later 8x8 -> 4x4
        self.conv2 = nn.Conv2d(6, 16, 5)       # 12x12 -> 8x8
        self.fc1 = nn.Linear(16 * 4 * 4, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def read_idx(path):
    """Read a gzipped IDX file (big-endian header) into a uint8 array."""
    with gzip.open(path, "rb") as f:
        data = f.read()
    magic = int.from_bytes(data[0:4], "big")
    if magic >> 8 != 0x08:  # 0x08 = unsigned byte
        raise ValueError(f"{path}: unsupported IDX type, magic {magic:#x}")
    ndim = magic & 0xFF
    dims = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def load_split(data_dir, split, limit):
    """split is 'train' or 't10k'; the first `limit` examples (0 = all).
    Returns (float32 [N,1,28,28] normalized, int64 [N])."""
    images = read_idx(os.path.join(data_dir, f"{split}-images-idx3-ubyte.gz"))
    labels = read_idx(os.path.join(data_dir, f"{split}-labels-idx1-ubyte.gz"))
    if limit:
        images, labels = images[:limit], labels[:limit]
    x = images.astype(np.float32) * np.float32(SCALE)
    x = (x - np.float32(MEAN)) / np.float32(STD)
    return (torch.from_numpy(x).unsqueeze(1),
            torch.from_numpy(labels.astype(np.int64)))


def evaluate(model, x, y, batch_size=1000):
    model.eval()
    total_loss, correct = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(x), batch_size):
            logits = model(x[i:i + batch_size])
            yb = y[i:i + batch_size]
            total_loss += F.cross_entropy(logits, yb, reduction="sum").item()
            correct += (logits.argmax(1) == yb).sum().item()
    return total_loss / len(x), correct, len(x)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.01, help="SGD learning rate")
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--limit", type=int, default=0,
                    help="use only the first N training and test images (0 = all)")
    ap.add_argument("--data", default=DEFAULT_DATA)
    ap.add_argument("--out", help="directory to write model.pt, model.json, metrics.json "
                                  "(default: a new temporary directory)")
    args = ap.parse_args()

    out = args.out or tempfile.mkdtemp(prefix="fashion_cnn-")
    os.makedirs(out, exist_ok=True)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    x_train, y_train = load_split(args.data, "train", args.limit)
    x_test, y_test = load_split(args.data, "t10k", args.limit)
    print(f"train {tuple(x_train.shape)}  test {tuple(x_test.shape)}", flush=True)

    model = Net()
    # The tutorial's SGD with momentum, with a larger batch and learning rate
    # than its 4 and 0.001 so that 2 epochs take a minute, not ten.
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    gen = torch.Generator().manual_seed(args.seed)

    start = time.time()
    for epoch in range(1, args.epochs + 1):
        model.train()
        perm = torch.randperm(len(x_train), generator=gen)
        running, seen = 0.0, 0
        for i in range(0, len(perm), args.batch_size):
            idx = perm[i:i + args.batch_size]
            loss = F.cross_entropy(model(x_train[idx]), y_train[idx])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            running += loss.item() * len(idx)
            seen += len(idx)
        test_loss, correct, count = evaluate(model, x_test, y_test)
        print(f"epoch {epoch}: train loss {running / seen:.4f}  test loss {test_loss:.4f}  "
              f"test accuracy {correct / count:.4f}  ({time.time() - start:.0f}s)", flush=True)

    model.eval()
    scripted = torch.jit.script(model)
    with torch.no_grad():
        assert torch.equal(scripted(x_test[:4]), model(x_test[:4]))
    scripted.save(os.path.join(out, "model.pt"))

    config = {
        "input": {"shape": [1, 28, 28], "dtype": "float32"},
        "preprocess": {"scale": SCALE, "mean": [MEAN], "std": [STD]},
        "output": "logits",
        "labels": LABELS,
    }
    with open(os.path.join(out, "model.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    metrics = {"epoch": args.epochs, "loss": round(test_loss, 6),
               "test_accuracy": correct / count}
    with open(os.path.join(out, "metrics.json"), "w") as f:
        json.dump(metrics, f)
        f.write("\n")
    print(f"wrote model.pt ({os.path.getsize(os.path.join(out, 'model.pt'))} bytes), "
          f"model.json, metrics.json to {out}")
    print(json.dumps(metrics))


if __name__ == "__main__":
    main()
