#!/usr/bin/python3
"""Measure the exported TorchScript model's accuracy on the FashionMNIST test set.

Prints two JSON lines:
  {"accuracy": A, "correct": C, "count": 10000}
  {"first10": {"predicted": [...], "labels": [...]}}

Usage:
    /usr/bin/python3 examples/fashion_mnist/eval_accuracy.py [--model model.pt]
"""
import argparse
import gzip
import json
import os

# Keep CPU use modest: one BLAS/OpenMP thread unless the caller says otherwise.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_DATA = "/usr/share/datasets/fashion-mnist"


def read_idx(path):
    """Read a gzipped IDX file (big-endian header) into a uint8 array."""
    with gzip.open(path, "rb") as f:
        data = f.read()
    magic = int.from_bytes(data[0:4], "big")
    if magic >> 8 != 0x08:
        raise ValueError(f"{path}: unsupported IDX type, magic {magic:#x}")
    ndim = magic & 0xFF
    dims = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=os.path.join(HERE, "model.pt"))
    ap.add_argument("--data", default=DEFAULT_DATA)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    images = read_idx(os.path.join(args.data, "t10k-images-idx3-ubyte.gz"))
    labels = read_idx(os.path.join(args.data, "t10k-labels-idx1-ubyte.gz"))
    # Same preprocessing as model.json: flatten to 784 and scale by 1/255.
    x = torch.from_numpy(images.reshape(len(images), 784).astype(np.float32) / 255.0)
    y = torch.from_numpy(labels.astype(np.int64))

    model = torch.jit.load(args.model)
    model.eval()
    preds = []
    with torch.no_grad():
        for i in range(0, len(x), 1000):
            preds.append(model(x[i:i + 1000]).argmax(1))
    pred = torch.cat(preds)
    correct = int((pred == y).sum().item())
    print(json.dumps({"accuracy": correct / len(y), "correct": correct,
                      "count": len(y)}))
    print(json.dumps({"first10": {"predicted": pred[:10].tolist(),
                                  "labels": y[:10].tolist()}}))


if __name__ == "__main__":
    main()
