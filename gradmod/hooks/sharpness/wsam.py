"""``wsam`` (Yue et al., 2023, weighted SAM), as pytorch-optimizer's ``WSAM``.

The move is SAM's. With ``a = gamma / (1 - gamma)``, the sharpness ``g_s - g`` (the
gradient at ``w + e`` less the one at ``w``) is added with weight ``a``:

* ``decouple: false``: the rule's gradient is ``g + a (g_s - g)`` (a ``lerp`` of ``g_s``
  towards ``g`` by ``1 - a``, as the reference computes it);
* ``decouple: true`` (the reference's default): the rule's gradient is ``g`` and, after
  ``optimizer.step()``, each parameter moves by ``-lr a (g_s - g)``, ``lr`` its group's
  learning rate: the stage needs the optimizer (``SharpnessStage.set_optimizer``; gradmod's
  trainer hands its own). Under accumulation the micro-batches' sharpness is summed; under
  fp16 it is unscaled first. A step the optimizer skips (GradScaler, the non-finite guard)
  skips it too.

The reference's ``max_norm`` (clipping ``g_s`` before the mix) is not offered.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from gradmod.hooks.sharpness.perturb import Ascent, Perturbation, sam_direction
from gradmod.hooks.validators import positive


class Wsam(Perturbation):
    """WSAM (Yue et al. 2023; pytorch-optimizer's WSAM): ``g`` plus ``gamma / (1 - gamma)`` times
    the sharpness ``g_s - g``, after the optimizer's step where ``decouple``."""

    name = "wsam"
    combines = True
    one_process = True

    def __init__(self, rho: float = 0.05, gamma: float = 0.9, decouple: bool = True):
        super().__init__(rho)
        self.gamma = positive(self.name, "gamma", gamma)
        if self.gamma >= 1:
            raise ValueError(
                f"transform {self.name!r}: gamma={gamma!r} must be >= 0 and < 1 (the weight is gamma / (1 - gamma))"
            )
        if not isinstance(decouple, bool):
            raise ValueError(f"transform {self.name!r}: decouple={decouple!r} must be true or false")
        self.decouple = decouple
        self.weight = self.gamma / (1.0 - self.gamma)
        self._pending: dict[Tensor, Tensor] = {}  # decoupled: parameter -> this step's sharpness

    @property
    def needs_optimizer(self) -> str | None:
        return "decouple: true moves the parameters after optimizer.step()" if self.decouple else None

    def direction(self, params: list[Tensor], grads: list[Tensor], at: Ascent) -> tuple[list[Tensor], Tensor]:
        if at.first:
            self._pending = {}  # a step the optimizer skipped leaves its sharpness behind
        return sam_direction(self.rho, grads, at)

    def combine(self, params: list[Tensor], first: list[Tensor], second: list[Tensor], at: Ascent) -> list[Tensor]:
        if not self.decouple:
            torch._foreach_lerp_(second, first, 1.0 - self.weight)
            return second
        torch._foreach_sub_(second, first)  # the sharpness g_s - g
        if at.scale is not None:  # fp16: the step moves by the unscaled sharpness
            torch._foreach_div_(second, at.scale)
        for p, s in zip(params, second):
            if p in self._pending:
                self._pending[p].add_(s)
            else:
                self._pending[p] = s
        return first

    def after_step(self, groups: list[dict[str, Any]]) -> None:
        if not self._pending:
            return
        with torch.no_grad():
            for group in groups:
                ps = [p for p in group["params"] if p in self._pending]
                if ps:
                    torch._foreach_add_(ps, [self._pending[p] for p in ps], alpha=-group["lr"] * self.weight)
        self._pending = {}
