"""One training epoch with a bare ``Trainer``: what tests and benchmarks time and compare.

No run folder, no callbacks but the non-finite guard and ``on_step``, no log points: the
trainer's step loop alone, on tensors already on the device.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor, nn

from gradmod.training.callbacks import Callback, NonFiniteCallback
from gradmod.training.distributed.strategy import Dist
from gradmod.training.trainer import Trainer, TrainerSettings


def bare_epoch(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    x: Tensor,
    y: Tensor,
    *,
    batch_size: int,
    generator: torch.Generator,
    hooks=None,
    on_step: Callable[[int], None] | None = None,
    progress: bool = False,
    accumulate: int = 1,
    part: tuple[int, int] = (0, 1),
    amp=None,
    guard=None,
    device: torch.device | None = None,
    loader_workers: int | None = None,
) -> float:
    """One shuffled pass over (x, y) with a bare ``Trainer``; returns the mean training loss.

    ``hooks`` (a ``HookSet``) runs its fused stage before each optimizer step; ``guard``
    (a ``NonFiniteGuard``) counts non-finite gradients and may skip a step; ``amp`` sets
    the precision; ``on_step(i)`` runs after optimizer step ``i`` of this epoch.
    ``accumulate``, ``part`` (this rank and the world size): see ``Trainer``.
    """

    class _OnStep(Callback):
        def on_step_end(self, trainer: Trainer) -> None:
            on_step(trainer.step)

    callbacks = ([NonFiniteCallback(guard)] if guard is not None else []) + ([_OnStep()] if on_step else [])
    device = y.device if device is None else device
    dist = Dist(rank=part[0], world_size=part[1], device=device)
    settings = TrainerSettings(
        batch_size=batch_size, accumulate=accumulate, progress=progress, loader_workers=loader_workers, log_every=2**62
    )  # no log points: the caller reads
    trainer = Trainer(
        model, optimizer, settings, hooks=hooks, amp=amp, callbacks=callbacks, dist=dist, generator=generator
    )
    return trainer.train_epoch(x, y)
