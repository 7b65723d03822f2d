"""The step's batch's losses after the optimizer step, for per_loss methods that learn from
them (famo with ``update_from: same_batch``, as its authors define it).

The trainer keeps the step's micro-batches; once the optimizer has stepped (a step the
non-finite policy skipped changed nothing and is left out), it computes their losses again
in a forward without gradients, the model as it trains (so dropout and BatchNorm act as in
the references' second forward), and hands their mean over the micro-batches to the hooks
(``HookSet.after_step``; the per_loss stage averages them over the ranks under DDP).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn


class AfterStepLosses:
    def __init__(self, hooks, net: nn.Module, tasks, amp):
        self.hooks, self.net, self.tasks, self.amp = hooks, net, tasks, amp
        self.batches: list[tuple[Tensor, Any]] = []

    def keep(self, xb: Tensor, yb: Any) -> None:
        self.batches.append((xb, yb))

    def after_step(self, taken: bool) -> None:
        batches, self.batches = self.batches, []
        if not taken or not batches:
            return
        sums: dict[str, Tensor] = {}
        with torch.no_grad(), self.amp.autocast():
            for xb, yb in batches:
                losses = self.tasks.losses(self.net(xb), yb)
                if isinstance(losses, Tensor):
                    return  # one loss: no per_loss rule can have run on it
                for k, v in losses.items():
                    sums[k] = sums[k] + v.float() if k in sums else v.float()
        self.hooks.after_step({k: v / len(batches) for k, v in sums.items()})
