"""``looksam`` (Liu et al., 2022), as pytorch-optimizer's ``LookSAM``: the SAM gradient on
one step in ``k``, its part orthogonal to ``g`` reused on the others.

On steps ``t`` with ``t % k == 0`` (the first included) the step takes SAM's two passes and
the gradient at ``w + e``, ``g_s``; per tensor, its part orthogonal to ``g`` is kept:

    g_v = g_s - ||g_s|| cos(g, g_s) g / ||g||      (norms clamped below at 1e-12)

On the other steps one forward and backward, and per tensor
``g + alpha ||g|| / (||g_v|| + 1e-8) g_v``: their cost is a plain step's and two passes over
the rule's gradients. (The reference's closure runs on every step, so its steps all cost
two forward and backward passes.) Under accumulation each micro-batch is corrected with its
own ``||g||``, and a two-pass step keeps the sum of its micro-batches' ``g_v``. ``g_v`` is
the stage's state (``hooks.state_dict()``).
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from gradmod.hooks.sharpness.gsam import dot
from gradmod.hooks.sharpness.perturb import EPS, Ascent, Perturbation, sam_direction
from gradmod.hooks.validators import count, in_range

GV_EPS = 1e-8  # added to ||g_v||, as the reference does


def _norms(tensors: list[Tensor]) -> Tensor:
    return torch.stack(torch._foreach_norm(tensors))


class LookSam(Perturbation):
    """LookSAM (Liu et al. 2022; pytorch-optimizer's LookSAM): SAM's two passes on one step in
    ``k``, in between ``g`` plus ``alpha`` times their part orthogonal to ``g``, one pass each."""

    name = "looksam"
    combines = True
    corrects = True
    one_process = True
    stateful = True

    def __init__(self, rho: float = 0.1, k: int = 10, alpha: float = 0.7):
        super().__init__(rho)
        self.k = count(f"transform {self.name!r}", "k", k, 1, math.inf)  # optimizer steps
        self.alpha = in_range(f"transform {self.name!r}", "alpha", alpha, 0.0, high=1.0)
        self._gv: WeakIdKeyDictionary = WeakIdKeyDictionary()  # parameter -> g_v

    def due(self, step: int) -> bool:
        return step % self.k == 0

    def direction(self, params: list[Tensor], grads: list[Tensor], at: Ascent) -> tuple[list[Tensor], Tensor]:
        return sam_direction(self.rho, grads, at)

    def combine(self, params: list[Tensor], first: list[Tensor], second: list[Tensor], at: Ascent) -> list[Tensor]:
        """Keep ``g_v`` per tensor (made in ``first``'s memory); the gradient is ``g_s``."""
        norm, norm_s = _norms(first), _norms(second)
        dots = torch.stack([dot([a], [b]) for a, b in zip(first, second)])
        coef = -norm_s * dots / (norm_s.clamp_min(EPS) * norm.clamp_min(EPS) ** 2)
        torch._foreach_mul_(first, list(coef.unbind()))
        torch._foreach_add_(first, second)
        for p, gv in zip(params, first):
            if not at.first and p in self._gv:
                self._gv[p].add_(gv)
            else:
                self._gv[p] = gv
        return second

    def correct(self, params: list[Tensor], grads: list[Tensor], at: Ascent) -> None:
        pairs = [(g, gv) for p, g in zip(params, grads) if (gv := self._gv.get(p)) is not None]
        if not pairs:
            return
        gs, gvs = [g for g, _ in pairs], [gv for _, gv in pairs]
        coef = self.alpha * _norms(gs) / (_norms(gvs) + GV_EPS)
        torch._foreach_addcmul_(gs, gvs, list(coef.unbind()))

    def state_dict(self, names: Mapping[Tensor, str]) -> dict[str, Any]:
        return {"gv": {names[p]: gv for p, gv in self._gv.items() if p in names}}

    def load_state_dict(self, state: Mapping[str, Any], params: Mapping[str, Tensor]) -> None:
        self._gv = WeakIdKeyDictionary()
        for name, gv in state.get("gv", {}).items():
            if name in params:
                self._gv[params[name]] = gv.to(params[name].device, params[name].dtype)
