"""``torch.optim.Adam`` with ``bias_correction=False``: the Adam step of LAMB as pytorch-optimizer's
``Lamb`` takes it (``m / (sqrt(v) + eps)``, the moments not divided by ``1 - beta ** step``).

Without bias correction Adam steps as it would at an infinitely late step, where ``beta ** step`` is 0:
torch's own step is given a step count that late (``2 ** 40``: ``0.999 ** 2 ** 40`` is 0 in float32),
and the real count, saved with the state, goes on as torch's would."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

LATE = 2.0**40


class Adam(torch.optim.Adam):
    """``torch.optim.Adam`` (same arguments and step; ``decoupled_weight_decay=True`` is AdamW) with
    ``bias_correction`` (True: torch's step unchanged)."""

    def __init__(self, params: Any, *args: Any, bias_correction: bool = True, **kwargs: Any) -> None:
        super().__init__(params, *args, **kwargs)
        for group in self.param_groups:
            group.setdefault("bias_correction", bias_correction)
        self.defaults["bias_correction"] = bias_correction

    def _init_group(
        self,
        group: Any,
        params_with_grad: Any,
        grads: Any,
        exp_avgs: Any,
        exp_avg_sqs: Any,
        max_exp_avg_sqs: Any,
        state_steps: list[Tensor],
    ) -> bool:  # type: ignore[override]
        has_complex = super()._init_group(
            group, params_with_grad, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps
        )
        if not group.get("bias_correction", True):
            for i, step in enumerate(state_steps):
                step += 1  # the count torch would keep; its step reads (and counts on) a late one
                state_steps[i] = torch.full_like(step, LATE)
        return has_complex
