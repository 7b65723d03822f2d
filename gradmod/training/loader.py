"""Batches of an epoch, and where the dataset lives: on the training device, or in host memory
behind a DataLoader.

``device`` (MNIST and anything that fits): one tensor on the device, batches indexed from
it (``batches``). ``loader``: the tensors stay in host memory and a
``DataLoader`` gathers each batch in worker processes, pins it and copies it to the device
without blocking, for datasets too big for the device. Both paths draw the same seeded
permutation, so they give the same batches in the same order.

Poisson sampling (``poisson_batches``, DP-SGD's assumption): each example joins each step
independently with probability ``sample_rate``, so batch sizes vary (and may be zero). The
masks are drawn on the host from the data-order generator, so a run resumed from the
epoch's generator state draws the same batches, on either path.
"""

from __future__ import annotations

import math
from typing import Iterator, Sequence

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from gradmod.data import Data, as_float
from gradmod.labels import nbytes

PLACEMENTS = ("auto", "device", "loader")
DEVICE_SHARE = 0.5  # auto: the dataset may take at most this share of the free device memory


class _IndexedBatches(Dataset):
    """Item ``i`` is the whole batch ``x[index[i]], y[index[i]]``: one gather per batch in
    the worker, instead of ``batch_size`` item calls and a collate."""

    def __init__(self, x: Tensor, y: Tensor, index: Sequence[Tensor]):
        self.x, self.y, self.index = x, y, index

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor, Tensor]:
        idx = self.index[i]
        return self.x[idx], self.y[idx], idx


def host_batches(
    x: Tensor, y: Tensor, index: Sequence[Tensor], device: torch.device, workers: int = 0, indexed: bool = False
) -> Iterator[tuple[Tensor, ...]]:
    """Batches of (float images, labels) on ``device`` from host tensors ``x``, ``y``: batch
    ``i`` is ``index[i]`` (CPU index tensors; ``batches`` draws them). ``indexed``: each
    batch's dataset indices come third."""
    cuda = device.type == "cuda"
    loader = DataLoader(_IndexedBatches(x, y, index), batch_size=None, num_workers=workers, pin_memory=cuda)
    for xb, yb, idx in loader:
        # From pinned memory the copies are asynchronous: the next batch is gathered meanwhile.
        batch = as_float(xb.to(device, non_blocking=cuda)), yb.to(device, non_blocking=cuda)
        yield (*batch, idx.to(device, non_blocking=cuda)) if indexed else batch


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
    size = sum(nbytes(t) for t in (data.train_x, data.train_y, data.test_x, data.test_y))
    return "device" if size <= DEVICE_SHARE * free else "loader"


def batches(
    x: Tensor,
    y: Tensor,
    batch_size: int,
    generator: torch.Generator | None = None,
    part: tuple[int, int] = (0, 1),
    start: int = 0,
    device: torch.device | None = None,
    loader_workers: int | None = None,
    parts: int | None = None,
    indexed: bool = False,
) -> Iterator[tuple[Tensor, ...]]:
    """Batches of (float images, labels) indexed from tensors already on the device;
    shuffled by ``generator`` (a CPU generator) when one is given. ``part=(rank, world)``
    keeps this rank's share of the shuffled order; ``start`` skips that many batches of it
    (resuming mid-epoch). With ``loader_workers`` set, a DataLoader gathers the same
    batches from host memory and copies them to ``device``. ``parts`` (unshuffled only):
    that many batches of near-equal size instead of ``batch_size`` each. ``indexed``
    (shuffled only): each batch's dataset indices come third (per-example scores)."""
    device = x.device if device is None else device
    if generator is None:
        cut = (lambda t: t.tensor_split(parts)) if parts else (lambda t: t.split(batch_size))
        if loader_workers is not None:
            yield from host_batches(x, y, cut(torch.arange(len(y))), device, loader_workers)
            return
        for xb, yb in zip(cut(x), cut(y)):
            yield as_float(xb), yb
        return
    order = torch.randperm(len(y), generator=generator)
    rank, world = part
    if world > 1:  # every rank draws the same permutation: rank r takes every world-th index,
        order = order[rank : len(order) - len(order) % world : world]  # all ranks the same count
    if loader_workers is not None:
        yield from host_batches(x, y, order.split(batch_size)[start:], device, loader_workers, indexed)
        return
    for idx in order.to(y.device).split(batch_size)[start:]:
        yield (as_float(x[idx]), y[idx], idx) if indexed else (as_float(x[idx]), y[idx])


def batches_per_epoch(n: int, batch_size: int, world: int = 1) -> int:
    """Batches in one rank's share of an epoch (``batches`` gives each rank n // world items)."""
    return math.ceil(n // world / batch_size)


def steps_per_epoch(n: int, batch_size: int, world: int = 1, accumulate: int = 1, sampling: str = "shuffle") -> int:
    """Optimizer steps in one rank's epoch: its batches in groups of ``accumulate`` (the last
    may be short); Poisson sampling: ``poisson_steps``."""
    if sampling == "poisson":
        return poisson_steps(n, batch_size, world, accumulate)[1]
    return math.ceil(batches_per_epoch(n, batch_size, world) / accumulate)


def poisson_batches(
    x: Tensor,
    y: Tensor,
    sample_rate: float,
    steps: int,
    generator: torch.Generator,
    split: int = 1,
    part: tuple[int, int] = (0, 1),
    start: int = 0,
    device: torch.device | None = None,
    loader_workers: int | None = None,
    indexed: bool = False,
) -> Iterator[tuple[Tensor, ...]]:
    """``steps`` Poisson batches: each example of (x, y) joins each with probability
    ``sample_rate`` (masks from ``generator``, on the host). Each batch comes as ``split``
    micro-batches (gradient accumulation: the step's one Poisson batch in near-equal parts,
    possibly empty); ``part=(rank, world)`` keeps this rank's share of every batch, drawn
    from the whole dataset alike on every rank. ``start`` skips that many micro-batches.
    ``indexed``: each batch's dataset indices come third."""
    device = x.device if device is None else device
    rank, world = part
    index = []
    for _ in range(steps):
        chosen = (torch.rand(len(y), generator=generator) < sample_rate).nonzero().flatten()
        index.extend(chosen[rank::world].tensor_split(split))
    index = index[start:]
    if loader_workers is not None:
        yield from host_batches(x, y, index, device, loader_workers, indexed)
        return
    for idx in index:
        idx = idx.to(y.device)
        yield (as_float(x[idx]), y[idx], idx) if indexed else (as_float(x[idx]), y[idx])


def poisson_steps(n: int, batch_size: int, world: int = 1, accumulate: int = 1) -> tuple[float, int]:
    """(sample rate, optimizer steps per epoch) of Poisson sampling with an expected global
    batch of ``batch_size * world * accumulate``: an epoch sees each example once on average."""
    expected = batch_size * world * accumulate
    return min(1.0, expected / n), max(1, n // expected)
