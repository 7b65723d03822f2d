"""A run whose loss or parameters become non-finite has diverged: it stops, and says where.

Whatever ``trainer.nonfinite`` says about gradients, a non-finite loss on a step that was
taken, or a non-finite parameter after it, leaves nothing worth training on: every later
step and the accuracy are noise (the argmax of nan logits is class 0). Each step counts
non-finite parameter entries and checks the step's loss on the device (a few ops for all
tensors at once, no host read); at the epoch's end, and before each checkpoint, one read
tells whether a step went bad, and the first such step is raised as ``Diverged``: no
checkpoint, metrics line or ``model.pt`` of non-finite numbers. A step skipped by the
non-finite policy (``skip``) changed no parameter, so its loss does not count.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from gradmod.training.callbacks import Callback
from gradmod.training.nonfinite import Diverged, count_nonfinite

WHAT = {1: "the loss", 2: "a parameter", 3: "the loss and a parameter"}


class DivergenceCallback(Callback):
    """Raises ``Diverged`` at the end of an epoch in which the loss or a parameter became
    non-finite."""

    key = "divergence"
    before = {"Checkpointer": "a diverged epoch leaves no checkpoint", "RunFiles": "nor a metrics line"}

    def __init__(self, params: Iterable[nn.Parameter]):
        self.params = list(params)
        device = self.params[0].device if self.params else torch.device("cpu")
        self.first = torch.zeros((), dtype=torch.long, device=device)  # 4 * step + what; 0: none yet
        self._skipped = 0  # the trainer's skipped steps before this step

    def on_step_start(self, trainer) -> None:
        self._skipped = trainer.skipped

    def on_step_end(self, trainer) -> None:
        taken = trainer.skipped == self._skipped
        what = 2 * (torch.stack(count_nonfinite(self.params)).sum() > 0).long()
        if taken and trainer.step_loss is not None:
            what = what + (~torch.isfinite(trainer.step_loss)).long()
        code = (what > 0).long() * (4 * trainer.step + what)
        self.first = torch.where(self.first == 0, code, self.first)

    def on_epoch_end(self, trainer, record: dict[str, Any]) -> None:
        self.raise_if_diverged()

    def raise_if_diverged(self) -> None:
        code = int(self.first.item())  # the epoch's one read
        if code:
            step, what = divmod(code, 4)
            raise Diverged(
                f"diverged: {WHAT[what]} became non-finite (nan or inf) at step {step}; lower "
                "optimizer.lr, look for a nan in the model or loss, or clip the gradients",
                step,
            )

    def state_dict(self) -> dict[str, Any]:
        """Called as a checkpoint is built: a diverged run raises instead, so no checkpoint
        holds non-finite numbers and there is no divergence to carry over."""
        self.raise_if_diverged()
        return {}
