"""gradmod's hook rules inside PyTorch Lightning: ``GradmodCallback``.

The callback takes the rules of a ``hooks/*.yaml`` file (a mapping, or the file's path),
attaches them to the LightningModule in ``setup``, runs the fused stage in
``on_before_optimizer_step`` (Lightning calls it after AMP unscaling and before its own
``gradient_clip_val``), and sends the ``log`` transform's statistics to the Trainer's
loggers every ``log_every_n_steps``. Needs ``pip install "gradmod[lightning]"``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from gradmod.hooks import HookSet, attach, load_rules

try:
    from lightning.pytorch.callbacks import Callback
except ImportError as e:  # the optional extra is missing
    raise ImportError('gradmod.integrations.lightning needs Lightning: pip install "gradmod[lightning]"') from e


class GradmodCallback(Callback):
    """Apply gradmod rules to a LightningModule's gradients.

    ``stage``: the default stage of rules that set none (``hook`` or ``fused``).
    ``log_every``: steps between reads of the ``log`` statistics (default: the Trainer's
    ``log_every_n_steps``); each read is one host sync.
    """

    def __init__(self, rules: Mapping[str, Any] | str | Path, stage: str = "hook", log_every: int | None = None):
        self.rules, self.stage, self.log_every = load_rules(rules), stage, log_every
        self.hooks: HookSet | None = None

    def setup(self, trainer, pl_module, stage: str) -> None:
        if self.hooks is None:  # fit, then test: attach once
            self.hooks = attach(pl_module, self.rules, stage=self.stage)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.hooks is not None and self.hooks.has_fused:
            self.hooks.after_backward()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        every = self.log_every or trainer.log_every_n_steps
        if self.hooks is None or not self.hooks.observers() or trainer.global_step % every:
            return
        flat = {f"grad/{key}/{field}": float(value) for key, stats in self.hooks.read_stats().items()
                for field, value in stats.items() if isinstance(value, (int, float))}
        if flat:
            for logger in trainer.loggers:
                logger.log_metrics(flat, step=trainer.global_step)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        if self.hooks is not None and stage == "fit":
            self.hooks.remove()
            self.hooks = None

    def state_dict(self) -> dict[str, Any]:
        return self.hooks.state_dict() if self.hooks is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.hooks is not None and state:
            self.hooks.load_state_dict(state)
