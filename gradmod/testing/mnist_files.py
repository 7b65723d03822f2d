"""MNIST's raw files written from tensors: ``torchvision.datasets.MNIST`` reads them back
(``download=False``), so a test or a benchmark runs torchvision's pipeline offline."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import torch
from torch import Tensor


def write_mnist_raw(root: str | os.PathLike, images: Tensor, labels: Tensor, train: bool) -> Path:
    """Write images/labels in MNIST's IDX format under ``root/MNIST/raw`` (for
    ``torchvision.datasets.MNIST(root, download=False)``)."""
    raw = Path(root) / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    prefix = "train" if train else "t10k"
    x = images.reshape(-1, 28, 28).to(torch.uint8).numpy()
    with open(raw / f"{prefix}-images-idx3-ubyte", "wb") as f:
        f.write(struct.pack(">IIII", 2051, len(x), 28, 28) + x.tobytes())
    with open(raw / f"{prefix}-labels-idx1-ubyte", "wb") as f:
        f.write(struct.pack(">II", 2049, len(labels)) + labels.to(torch.uint8).numpy().tobytes())
    return raw
