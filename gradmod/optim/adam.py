"""``torch.optim.Adam`` with ``bias_correction=False``: the Adam step of LAMB as pytorch-optimizer's
``Lamb`` takes it (``m / (sqrt(v) + eps)``, the moments not divided by ``1 - beta ** step``).

Without bias correction Adam steps as it would at an infinitely late step, where ``beta ** step`` is 0:
torch's own step is given a step count that late (``2 ** 40``: ``0.999 ** 2 ** 40`` is 0 in float32),
and the real count, saved with the state, goes on as torch's would.

A group with ``trust_ratio: {of: update}`` (LAMB) steps in ``gradmod.optim.lamb`` instead, Adam and
its ratio fused over the group's tensors. It is taken in ``_init_group``, which torch's ``step`` calls
once per group, and leaves torch's ``step`` nothing to step for that group: torch's ``step`` (its
closure, its step hooks, once) and the other groups stay as they are."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from gradmod.optim import lamb

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
        if lamb.fits(group):
            ps: list[Tensor] = []
            gs: list[Tensor] = []
            ms: list[Tensor] = []
            vs: list[Tensor] = []
            counts: list[Tensor] = []
            super()._init_group(group, ps, gs, ms, vs, [], counts)
            lamb.step(group, ps, gs, ms, vs, counts)
            return False  # the lists stay empty: torch's step has nothing left in this group
        has_complex = super()._init_group(
            group, params_with_grad, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps
        )
        if not group.get("bias_correction", True):
            for i, step in enumerate(state_steps):
                step += 1  # the count torch would keep; its step reads (and counts on) a late one
                state_steps[i] = torch.full_like(step, LATE)
        return has_complex

    def takes_trust_ratio(self, group: Any) -> bool:
        """Whether this step applies ``group``'s ``trust_ratio`` itself (``gradmod.optim.trust_ratio``'s
        hooks then leave the group alone)."""
        return lamb.fits(group)
