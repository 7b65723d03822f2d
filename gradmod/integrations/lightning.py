"""gradmod's hook rules inside PyTorch Lightning: ``GradmodCallback``.

The callback takes rules (a mapping, a ``hooks/*.yaml`` path, a shipped file's name such
as ``"log"``, or a list of these), attaches them to the LightningModule in ``setup`` and
removes them in ``teardown`` of every stage (fit, validate, test, predict), so nothing
stays attached outside the Trainer. The fused stage runs in ``on_before_optimizer_step``
(Lightning calls it after AMP unscaling and before its own ``gradient_clip_val``); the
``log`` transform's statistics go to the Trainer's loggers every ``log_every_n_steps``.
Several callbacks share one model when their rules select different tensors. A curvature
rule is estimated, not attached (``gradmod.integrations.curvature_probe``): on the first training
batch's ``(x, y)``, with the loss ``loss_fn(module(x), y)``; its values go to the loggers too, and
its rows and probe batch travel in the callback's checkpoint state.
Needs ``pip install "gradmod[lightning]"``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping

from gradmod.hooks import HookSet, load_rules, stages
from gradmod.integrations.curvature_probe import Probe
from gradmod.integrations.support import attach_for, flat_stats, refuse_private, sources

try:
    from lightning.pytorch.callbacks import Callback
except ImportError as e:  # the optional extra is missing
    raise ImportError('gradmod.integrations.lightning needs Lightning: pip install "gradmod[lightning]"') from e


class GradmodCallback(Callback):
    """Apply gradmod rules to a LightningModule's gradients.

    ``stage``: the default stage of rules that set none (``hook`` or ``fused``).
    ``log_every``: steps between reads of the ``log`` statistics (default: the Trainer's
    ``log_every_n_steps``); each read is one host sync. ``total_steps``,
    ``steps_per_epoch``: the run's length in optimizer steps for schedules and windows in
    ``dur`` or ``ep`` (default: the Trainer's ``max_steps``, else its estimate). The step
    clock is the Trainer's ``global_step``, so a resumed fit continues the schedules.
    ``loss_fn``: the loss a curvature rule estimates, ``loss_fn(module(x), y)`` on the first
    ``batch`` examples of the first training batch ``(x, y, ...)``; its estimates are
    ``curvature_rows``, kept with the probe batch in checkpoints (a resumed fit continues them).
    """

    def __init__(
        self,
        rules: Mapping[str, Any] | str | Path | list,
        stage: str = stages.DEFAULT,
        log_every: int | None = None,
        total_steps: int | None = None,
        steps_per_epoch: int | None = None,
        loss_fn: Callable[[Any, Any], Any] | None = None,
    ):
        self.rules, self.stage, self.log_every = load_rules(rules), stage, log_every
        self.total_steps, self.steps_per_epoch = total_steps, steps_per_epoch
        refuse_private("Lightning", self.rules, stage)  # when the callback is made, not at fit()
        self.probe, self.loss_fn = Probe(self.rules), loss_fn
        if self.probe and loss_fn is None:
            raise ValueError(
                f"hooks.{self.probe.estimates.rules[0].rule}: a curvature rule under Lightning needs its loss: "
                "GradmodCallback(rules, loss_fn=F.cross_entropy) estimates loss_fn(module(x), y)"
            )
        self.sources = sources(rules)  # for the line that refuses two callbacks on one tensor
        self.hooks: HookSet | None = None
        self._state: dict[str, Any] = {}  # rule state to restore at the next training start
        self._read_at = 0  # the step of the last read: accumulated batches share a step

    @property
    def state_key(self) -> str:
        # Keyed by its rules: several callbacks in one Trainer each keep their own state.
        return self._generate_state_key(rules=",".join(self.rules), stage=self.stage)

    def setup(self, trainer, pl_module, stage: str) -> None:
        if self.hooks is None:
            scaled = getattr(trainer.precision_plugin, "scaler", None) is not None  # fp16's GradScaler
            peers = {
                cb.sources: cb.hooks
                for cb in trainer.callbacks
                if isinstance(cb, GradmodCallback) and cb is not self and cb.hooks is not None
            }
            total, per_epoch = self._length(trainer)
            self.probe.check(pl_module)
            self.hooks = attach_for(
                "Lightning", pl_module, self.probe.rest, self.stage, scaled, (self.sources, peers), total, per_epoch
            )

    def _length(self, trainer) -> tuple[int | None, int | None]:
        """(total optimizer steps, per epoch): given, else what the Trainer can say now."""
        total, per_epoch = self.total_steps, self.steps_per_epoch
        if total is None and trainer.max_steps and trainer.max_steps > 0:
            total = int(trainer.max_steps)
        if total is None or per_epoch is None:
            try:  # loads the train dataloader's length; unknown (an iterable) -> left None
                estimate = int(trainer.estimated_stepping_batches)
            except Exception:  # noqa: BLE001  (no length: rules in ep/dur are refused in one line)
                estimate = None
            if estimate is not None and estimate > 0:
                total = estimate if total is None else total
                epochs = trainer.max_epochs if trainer.max_epochs and trainer.max_epochs > 0 else None
                if per_epoch is None and epochs and estimate % epochs == 0:
                    per_epoch = estimate // epochs
        return total, per_epoch

    @property
    def curvature_rows(self) -> list[dict[str, Any]]:
        """One row per curvature estimate and group: ``{step, lr, rule, group, top1.., trace, trace_se, hvps, residual}``."""
        return self.probe.estimates.rows

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.hooks is not None and self.hooks.timed:
            self.hooks.set_step(int(trainer.global_step))  # accumulated micro-batches share it
        if self.probe:
            self.probe.keep(batch)
            if trainer.global_step == 0:
                self._curvature(trainer, pl_module)  # before the first optimizer step

    def _curvature(self, trainer, pl_module) -> None:
        """The curvature rules due at this step, their values to every logger."""
        if not isinstance(self.probe.batch, (list, tuple)) or len(self.probe.batch) < 2:
            rule = self.probe.estimates.rules[0].rule
            raise ValueError(f"hooks.{rule}: under Lightning the probe batch is (x, y, ...); the first batch is not")
        optimizer = trainer.optimizers[0] if trainer.optimizers else None
        now = self.probe.run(pl_module, self.loss_fn, trainer.global_step, optimizer, lambda b: (b[0], b[1]))
        for logger in trainer.loggers if now else ():
            logger.log_metrics(now, step=trainer.global_step)

    def on_train_start(self, trainer, pl_module) -> None:
        self._read_at = trainer.global_step
        # The module is on its device now, and a checkpoint's state has been loaded.
        if self.hooks is not None and self._state:
            self.hooks.load_state_dict(self._state, pl_module.device)
            self._state = {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.hooks is not None and self.hooks.needs_after_backward:
            self.hooks.after_backward()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.probe:
            self._curvature(trainer, pl_module)  # after the optimizer step (once per step)
        every, step = self.log_every or trainer.log_every_n_steps, trainer.global_step
        if self.hooks is None or not self.hooks.observers() or step % every or step == self._read_at:
            return
        self._read_at = step
        flat = flat_stats(self.hooks)
        if flat:
            for logger in trainer.loggers:
                logger.log_metrics(flat, step=trainer.global_step)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        if self.hooks is not None:
            self._state = self.hooks.state_dict()
            self.hooks.remove()
            self.hooks = None

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self.teardown(trainer, pl_module, "exception")  # Lightning skips teardown when a stage fails

    def state_dict(self) -> dict[str, Any]:
        state = self.hooks.state_dict() if self.hooks is not None and not self._state else self._state
        return {**state, "curvature": self.probe.state_dict()} if self.probe else state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = dict(state)
        if self.probe and "curvature" in state:  # the rows so far and the probe batch
            self.probe.load_state_dict(state["curvature"])
        state.pop("curvature", None)
        self._state = state  # the rules' state, applied in on_train_start
