"""Trainer callbacks: what happens at the Trainer's named moments.

A callback overrides the moments it needs and keeps its own state in ``state_dict`` /
``load_state_dict``; checkpoints store each under the callback's ``key``. Callbacks run
in list order at every moment. The moments, in the order a step meets them:

``on_fit_start``, ``on_step_start`` (before the step's first forward), ``on_after_backward``
(the raw accumulated ``.grad``), ``on_before_optimizer_step`` (after unscaling and the
fused hook stage; return True to skip this step), ``on_log`` (at a log point, with the
``log`` statistics read), ``on_step_end``, ``on_epoch_end`` (with the epoch's record),
``on_fit_end``.
"""

from __future__ import annotations

from typing import Any

from gradmod.training.nonfinite import NonFiniteGuard
from gradmod.training.speed import SyncCheck


class Callback:
    """Does nothing at every moment; subclasses override what they need."""

    @property
    def key(self) -> str:
        """The name of this callback's state in a checkpoint."""
        return type(self).__name__

    def on_fit_start(self, trainer) -> None: ...

    def on_missing_state(self, steps: int) -> None:
        """A resume from a checkpoint of ``steps`` steps that holds no state of this callback."""

    def on_step_start(self, trainer) -> None: ...

    def on_after_backward(self, trainer) -> None: ...

    def on_before_optimizer_step(self, trainer) -> bool:
        return False

    def on_log(self, trainer, stats: dict[str, Any]) -> None: ...

    def on_step_end(self, trainer) -> None: ...

    def on_epoch_end(self, trainer, record: dict[str, Any]) -> None: ...

    def on_fit_end(self, trainer) -> None: ...

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class NonFiniteCallback(Callback):
    """``trainer.nonfinite``: count non-finite raw gradients and warn, skip or raise
    (``gradmod.training.nonfinite``)."""

    key = "guard"

    def __init__(self, guard: NonFiniteGuard):
        self.guard = guard

    def on_after_backward(self, trainer) -> None:
        self.guard.observe()  # raw .grad of what no hook saw, before the fused stage

    def on_before_optimizer_step(self, trainer) -> bool:
        return self.guard.check(trainer.amp.scale())

    def on_epoch_end(self, trainer, record: dict[str, Any]) -> None:
        self.guard.flush()  # warn: the epoch's counts, read once

    def state_dict(self) -> dict[str, Any]:
        return self.guard.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.guard.load_state_dict(state)


class SyncCheckCallback(Callback):
    """``trainer.sync_check``: on CUDA, a host sync from a step's first forward to its
    optimizer step (hooks, fused stage and non-finite check included) raises. Put it last:
    it allows syncs again once the other callbacks' ``on_before_optimizer_step`` ran."""

    def __init__(self, check: SyncCheck):
        self.check = check

    def on_step_start(self, trainer) -> None:
        self.check.forbid()

    def on_before_optimizer_step(self, trainer) -> bool:
        self.check.allow()
        return False

    def on_fit_end(self, trainer) -> None:
        self.check.allow()
