"""Where the dataset lives: on the training device, or in host memory behind a DataLoader.

``device`` (MNIST and anything that fits): one tensor on the device, batches indexed from
it (``gradmod.training.trainer.batches``). ``loader``: the tensors stay in host memory and a
``DataLoader`` gathers each batch in worker processes, pins it and copies it to the device
without blocking, for datasets too big for the device. Both paths draw the same seeded
permutation, so they give the same batches in the same order.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from gradmod.data import Data, as_float

PLACEMENTS = ("auto", "device", "loader")
DEVICE_SHARE = 0.5  # auto: the dataset may take at most this share of the free device memory


class _IndexedBatches(Dataset):
    """Item ``i`` is the whole batch ``x[index[i]], y[index[i]]``: one gather per batch in
    the worker, instead of ``batch_size`` item calls and a collate."""

    def __init__(self, x: Tensor, y: Tensor, index: Sequence[Tensor]):
        self.x, self.y, self.index = x, y, index

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        idx = self.index[i]
        return self.x[idx], self.y[idx]


def host_batches(x: Tensor, y: Tensor, index: Sequence[Tensor], device: torch.device,
                 workers: int = 0) -> Iterator[tuple[Tensor, Tensor]]:
    """Batches of (float images, labels) on ``device`` from host tensors ``x``, ``y``: batch
    ``i`` is ``index[i]`` (CPU index tensors; ``gradmod.training.trainer.batches`` draws them)."""
    cuda = device.type == "cuda"
    loader = DataLoader(_IndexedBatches(x, y, index), batch_size=None, num_workers=workers, pin_memory=cuda)
    for xb, yb in loader:
        # From pinned memory the copies are asynchronous: the next batch is gathered meanwhile.
        yield as_float(xb.to(device, non_blocking=cuda)), yb.to(device, non_blocking=cuda)


def placement(setting: str, data: Data, device: torch.device) -> str:
    """``device`` or ``loader`` for ``trainer.data_placement``; ``auto`` keeps the data
    on the device when it fits in ``DEVICE_SHARE`` of the free device memory (always on
    the CPU, where it is already in memory)."""
    if setting not in PLACEMENTS:
        raise ValueError(f"trainer.data_placement={setting!r} is not allowed; allowed: {', '.join(PLACEMENTS)}")
    if setting != "auto":
        return setting
    if device.type != "cuda":
        return "device"
    free, _ = torch.cuda.mem_get_info(device)
    size = sum(t.numel() * t.element_size() for t in (data.train_x, data.train_y, data.test_x, data.test_y))
    return "device" if size <= DEVICE_SHARE * free else "loader"
