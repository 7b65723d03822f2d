"""The pieces of an epoch: batches drawn from tensors, and batched evaluation.

``train_epoch`` and ``evaluate`` are also the plain-function way to train without a run
folder (benchmarks, scripts, tests): ``train_epoch`` is one epoch of a bare ``Trainer``.
"""

from __future__ import annotations

import math
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gradmod.data import as_float
from gradmod.training.loader import host_batches


def batches(x: Tensor, y: Tensor, batch_size: int, generator: torch.Generator | None = None,
            shard: tuple[int, int] = (0, 1), start: int = 0, device: torch.device | None = None,
            loader_workers: int | None = None) -> Iterator[tuple[Tensor, Tensor]]:
    """Batches of (float images, labels) indexed from tensors already on the device;
    shuffled by ``generator`` (a CPU generator) when one is given. ``shard=(rank, world)``
    keeps this rank's share of the shuffled order; ``start`` skips that many batches of it
    (resuming mid-epoch). With ``loader_workers`` set, a DataLoader gathers the same
    batches from host memory and copies them to ``device`` (``gradmod.training.loader``)."""
    device = x.device if device is None else device
    if generator is None:
        if loader_workers is not None:
            yield from host_batches(x, y, torch.arange(len(y)).split(batch_size), device, loader_workers)
            return
        for xb, yb in zip(x.split(batch_size), y.split(batch_size)):
            yield as_float(xb), yb
        return
    order = torch.randperm(len(y), generator=generator)
    rank, world = shard
    if world > 1:  # every rank draws the same permutation: rank r takes every world-th index,
        order = order[rank:len(order) - len(order) % world:world]  # all ranks the same count
    if loader_workers is not None:
        yield from host_batches(x, y, order.split(batch_size)[start:], device, loader_workers)
        return
    for idx in order.to(y.device).split(batch_size)[start:]:
        yield as_float(x[idx]), y[idx]


def batches_per_epoch(n: int, batch_size: int, world: int = 1) -> int:
    """Batches in one rank's share of an epoch (``batches`` gives each rank n // world items)."""
    return math.ceil(n // world / batch_size)


def steps_per_epoch(n: int, batch_size: int, world: int = 1, accumulate: int = 1) -> int:
    """Optimizer steps in one rank's epoch: its batches in groups of ``accumulate`` (the last may be short)."""
    return math.ceil(batches_per_epoch(n, batch_size, world) / accumulate)


@torch.no_grad()
def evaluate(model: nn.Module, x: Tensor, y: Tensor, *, batch_size: int = 1000,
             device: torch.device | None = None, loader_workers: int | None = None) -> tuple[float, float]:
    """Batched evaluation: (mean cross-entropy, accuracy), read from the device once."""
    model.eval()
    device = y.device if device is None else device
    loss = torch.zeros((), device=device)
    correct = torch.zeros((), device=device, dtype=torch.long)
    for xb, yb in batches(x, y, batch_size, device=device, loader_workers=loader_workers):
        out = model(xb)
        loss += F.cross_entropy(out, yb, reduction="sum")
        correct += (out.argmax(1) == yb).sum()
    loss_sum, n_correct = torch.stack([loss, correct.to(loss.dtype)]).tolist()
    return loss_sum / len(y), n_correct / len(y)


def train_epoch(model: nn.Module, optimizer: torch.optim.Optimizer, x: Tensor, y: Tensor, *,
                batch_size: int, generator: torch.Generator, hooks=None,
                on_step: Callable[[int], None] | None = None, progress: bool = False,
                accumulate: int = 1, shard: tuple[int, int] = (0, 1), amp=None, guard=None,
                device: torch.device | None = None, loader_workers: int | None = None) -> float:
    """One shuffled pass over (x, y) with a bare ``Trainer``; returns the mean training loss.

    ``hooks`` (a ``HookSet``) runs its fused stage before each optimizer step; ``guard``
    (a ``NonFiniteGuard``) counts non-finite gradients and may skip a step; ``amp`` sets
    the precision; ``on_step(i)`` runs after optimizer step ``i`` of this epoch.
    ``accumulate``, ``shard``: see ``Trainer``.
    """
    from gradmod.training.callbacks import Callback, NonFiniteCallback
    from gradmod.training.distributed import Dist
    from gradmod.training.trainer import Trainer

    class _OnStep(Callback):
        def on_step_end(self, trainer: Trainer) -> None:
            on_step(trainer.step)

    callbacks = ([NonFiniteCallback(guard)] if guard is not None else []) + ([_OnStep()] if on_step else [])
    device = y.device if device is None else device
    dist = Dist(rank=shard[0], world_size=shard[1], device=device)
    trainer = Trainer(model, optimizer, hooks=hooks, amp=amp, callbacks=callbacks, dist=dist,
                      accumulate=accumulate, batch_size=batch_size, progress=progress,
                      loader_workers=loader_workers, generator=generator, log_every=2**62)
    return trainer.train_epoch(x, y)
