"""Learning-rate schedules: stepped once per optimizer step, saved in checkpoints, their rate in
the metrics (the objects are built from ``scheduler._target_`` by ``gradmod.run.factories``)."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.optim import lr_scheduler

from gradmod.training.callbacks import Callback


def warmup_cosine(
    optimizer: torch.optim.Optimizer,
    warmup_steps: int,
    total_steps: int,
    start_factor: float = 0.01,
    eta_min: float = 0.0,
) -> lr_scheduler.LRScheduler:
    """Linear warm-up from ``start_factor * lr`` over ``warmup_steps``, then cosine to ``eta_min``."""
    if not 0 < warmup_steps < total_steps:
        raise ValueError(f"warmup_steps={warmup_steps} must be between 1 and total_steps-1={total_steps - 1}")
    warm = lr_scheduler.LinearLR(optimizer, start_factor=start_factor, end_factor=1.0, total_iters=warmup_steps)
    cosine = lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_steps - warmup_steps, eta_min=eta_min)
    return lr_scheduler.SequentialLR(optimizer, [warm, cosine], milestones=[warmup_steps])


def learning_rate(optimizer: torch.optim.Optimizer) -> float:
    return float(optimizer.param_groups[0]["lr"])


class SchedulerCallback(Callback):
    """Steps ``scheduler`` after every optimizer step (skipped steps too, so the schedule
    follows the step count) and puts the rate into each epoch's record (``lr``: the
    rate of the first parameter group for the next step; ``lr_groups``: every group's by name where
    there are several, Muon's adjusted rate too), so metrics and loggers get it."""

    key = "scheduler"
    before = {"Checkpointer": "a checkpoint holds the schedule's state after the step it records"}

    def __init__(
        self, scheduler: lr_scheduler.LRScheduler | None, rates: Callable[[Any], dict[str, float]] | None = None
    ):
        self.scheduler = scheduler
        self.rates = rates  # the groups' rates by name (gradmod.optim.rates): a record's lr_groups

    def on_step_end(self, trainer) -> None:
        if self.scheduler is not None:
            self.scheduler.step()

    def on_epoch_end(self, trainer, record: dict[str, Any]) -> None:
        record["lr"] = learning_rate(trainer.optimizer)  # the rate the next step will use
        named = self.rates(trainer.optimizer) if self.rates is not None else {}
        if len(named) > 1:
            record["lr_groups"] = named

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict() if self.scheduler is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scheduler is not None and state:
            self.scheduler.load_state_dict(state)
