"""Trainer callbacks: what happens at the Trainer's named moments.

A callback overrides the moments it needs and keeps its own state in ``state_dict`` /
``load_state_dict``; checkpoints store each under the callback's ``key``. Callbacks run
in list order at every moment. The moments, in the order a step meets them:

``on_fit_start``, ``on_step_start`` (before the step's first forward), ``on_after_backward``
(the raw accumulated ``.grad``), ``on_before_optimizer_step`` (after unscaling and the
fused hook stage; return True to skip this step), ``on_log`` (at a log point, with the
``log`` statistics read), ``on_step_end``, ``on_epoch_end`` (with the epoch's record),
``on_fit_end``.

Where a callback runs among the others is data on its class, checked whenever a Trainer
gets its callbacks (``check_order``): ``before`` names the callbacks (by ``key``) that must
run after it, each with the reason; ``last`` callbacks run after every other. Two
callbacks with one state ``key`` are refused: a checkpoint keeps one state per key.
"""

from __future__ import annotations

import logging
import time
from typing import Any, ClassVar, Sequence

from gradmod.reporting.console import epoch_line
from gradmod.reporting.progress import Progress, duration
from gradmod.training.nonfinite import NonFiniteGuard
from gradmod.training.speed import SyncCheck

log = logging.getLogger(__name__)


class Callback:
    """Does nothing at every moment; subclasses override what they need."""

    before: ClassVar[dict[str, str]] = {}  # key of a callback that must run later -> why
    last: ClassVar[bool] = False  # after every callback that is not ``last``

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


def check_order(callbacks: Sequence[Any]) -> None:
    """A ``ValueError`` naming the first callback out of its declared place, or a state key
    that two callbacks share."""
    keys = [cb.key for cb in callbacks]
    shared = next((k for k in keys if keys.count(k) > 1), None)
    if shared is not None:
        raise ValueError(
            f"two callbacks have the state key {shared!r}: a checkpoint keeps one state per key; "
            "give each callback a key of its own"
        )
    for i, cb in enumerate(callbacks):
        for later, why in getattr(cb, "before", {}).items():
            if later in keys[:i]:
                raise ValueError(f"callback {cb.key} must run before {later} ({why}), but comes after it")
        final = next((c for c in callbacks[:i] if getattr(c, "last", False)), None)
        if final is not None and not getattr(cb, "last", False):
            raise ValueError(f"callback {cb.key} comes after {final.key}, which runs last")


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
    optimizer step (hooks, fused stage and non-finite check included) raises. Last: it
    allows syncs again once the other callbacks' ``on_before_optimizer_step`` ran."""

    last = True
    before = {"StopOnSignal": "its checkpoint and collective come after the step's syncs are allowed again"}

    def __init__(self, check: SyncCheck):
        self.check = check

    def on_step_start(self, trainer) -> None:
        self.check.forbid()

    def on_before_optimizer_step(self, trainer) -> bool:
        self.check.allow()
        return False

    def on_fit_end(self, trainer) -> None:
        self.check.allow()


class EpochLine(Callback):
    """The console's lines of an epoch, a terminal or a redirected file alike: in a long one a
    progress line now and then (``gradmod.reporting.progress``: batches done, about how long is
    left), then the epoch's line (``gradmod.reporting.console``) with every distinct learning
    rate of the optimizer's groups; it comes after the callbacks that add to the record
    (epsilon). ``compiled``: the model runs through ``torch.compile``: a line as the first step
    starts compiling, and how long that step and the first evaluation took."""

    def __init__(self, epochs: int | None = None, compiled: bool = False):
        self.epochs = epochs
        self.progress: Progress | None = None
        self.compiling: float | None = None  # compiled: when the fit's first step started, until it ends
        self.to_tell = ["step", "evaluation"] if compiled else []  # what compiles first, not yet timed

    def on_step_start(self, trainer) -> None:
        if self.progress is None:  # the epoch's first step (a resumed one starts part way)
            self.progress = Progress(trainer.epoch_batches, "batches", start=trainer.batch)
        if self.to_tell[:1] == ["step"] and self.compiling is None:
            log.info(
                "torch.compile (trainer.compile=true): compiling the model as its first step runs, forward "
                "and backward (evaluation compiles at its first batch); this can take minutes"
            )
            self.compiling = time.perf_counter()

    def on_step_end(self, trainer) -> None:
        if self.compiling is not None:
            took, self.compiling = time.perf_counter() - self.compiling, None
            log.info("torch.compile: the first step took %s, compilation included", duration(took))
            self.to_tell.remove("step")
        line = self.progress.update(trainer.batch) if self.progress is not None else None
        if line is not None:
            log.info("epoch %s%s: %s", trainer.epoch, f"/{self.epochs}" if self.epochs else "", line)

    def on_epoch_end(self, trainer, record: dict[str, Any]) -> None:
        self.progress = None
        rates = [group["lr"] for group in trainer.optimizer.param_groups if "lr" in group]
        log.info("%s", epoch_line(record, self.epochs, rates))
        if self.to_tell == ["evaluation"] and "eval_seconds" in record:
            took = duration(record["eval_seconds"])
            log.info("torch.compile: the first evaluation took %s, compilation included", took)
            self.to_tell.clear()
