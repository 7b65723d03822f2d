"""``friendly_sam`` (Li et al., 2024, Friendly SAM), as pytorch-optimizer's ``FriendlySAM``:
the ascent along the batch's noise only, its gradient less ``sigma`` times a momentum of
the past ones.

Per parameter, with ``m`` the momentum (the first gradient itself, the first time a
parameter has one):

    d = g - sigma m,      then      m = lmbda m + (1 - lmbda) g

and the move is ``e = rho d / (||d|| + 1e-12)``; the rule's gradient is the one at
``w + e``. Every micro-batch's first pass is one update of ``m`` (a step of one micro-batch
is the reference's step). ``m`` is the stage's state (``hooks.state_dict()``).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from gradmod.hooks.sharpness.perturb import Ascent, Perturbation, sam_direction
from gradmod.hooks.validators import MAX_STEP, in_range, positive


class FriendlySam(Perturbation):
    """Friendly SAM (Li et al. 2024; pytorch-optimizer's FriendlySAM): SAM's move along
    ``g - sigma m``, ``m`` a momentum (decay ``lmbda``) of the first passes' gradients."""

    name = "friendly_sam"
    one_process = True
    stateful = True

    def __init__(self, rho: float = 0.05, sigma: float = 1.0, lmbda: float = 0.9):
        super().__init__(rho)
        self.sigma = positive(self.name, "sigma", sigma, high=MAX_STEP)
        self.lmbda = in_range(f"transform {self.name!r}", "lmbda", lmbda, 0.0, high=1.0)
        self._m: WeakIdKeyDictionary = WeakIdKeyDictionary()  # parameter -> momentum

    def direction(self, params: list[Tensor], grads: list[Tensor], at: Ascent) -> tuple[list[Tensor], Tensor]:
        old = [(g, m) for p, g in zip(params, grads) if (m := self._m.get(p)) is not None]
        for p, g in zip(params, grads):
            if p not in self._m:
                self._m[p] = g.clone()
        if old:
            gs, ms = [g for g, _ in old], [m for _, m in old]
            w = 1.0 - self.lmbda
            torch._foreach_add_(gs, ms, alpha=-self.sigma)  # d = g - sigma m
            if self.sigma != 1.0:  # m = lmbda m + w g = (1 + w (sigma - 1)) m + w d
                torch._foreach_mul_(ms, 1.0 + w * (self.sigma - 1.0))
            torch._foreach_add_(ms, gs, alpha=w)
        return sam_direction(self.rho, grads, at)

    def state_dict(self, names: Mapping[Tensor, str]) -> dict[str, Any]:
        return {"momentum": {names[p]: m for p, m in self._m.items() if p in names}}

    def load_state_dict(self, state: Mapping[str, Any], params: Mapping[str, Tensor]) -> None:
        self._m = WeakIdKeyDictionary()
        for name, m in state.get("momentum", {}).items():
            if name in params:
                self._m[params[name]] = m.to(params[name].device, params[name].dtype)
