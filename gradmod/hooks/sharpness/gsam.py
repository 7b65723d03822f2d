"""``gsam`` (Zhuang et al., 2022, surrogate gap guided SAM), as pytorch-optimizer's ``GSAM``.

The move is SAM's, ``e = rho_t g / (||g|| + 1e-12)``. The rule's gradient is the gradient
at ``w + e``, ``g_s``, minus ``alpha`` times the part of ``g`` orthogonal to it:

    cos = <g, g_s> / (||g_s|| ||g|| + 1e-12)
    v = g - cos ||g|| g_s / (||g_s|| + 1e-12)
    gradient = g_s - alpha v

With ``rho_min`` set, ``rho`` follows the learning rate as in the paper and in
pytorch-optimizer's ``ProportionScheduler``: ``rho_t = rho_min + (rho - rho_min)
(lr_t - lr_min) / (lr_max - lr_min)``, ``lr_t`` the learning rate the optimizer steps the
rule's first parameter with at step ``t`` (the stage reads it live from the optimizer
handed to it: ``SharpnessStage.set_optimizer``; gradmod's trainer hands its own).
"""

from __future__ import annotations

import torch
from torch import Tensor

from gradmod.hooks.sharpness.perturb import EPS, Ascent, Perturbation, global_norm, sam_direction
from gradmod.hooks.validators import MAX_STEP, in_range, positive


def dot(a: list[Tensor], b: list[Tensor]) -> Tensor:
    """``<a, b>`` over all the tensors together, on the device."""
    return torch.stack([torch.vdot(x.reshape(-1), y.reshape(-1)) for x, y in zip(a, b)]).sum()


class Gsam(Perturbation):
    """GSAM (Zhuang et al. 2022; pytorch-optimizer's GSAM): SAM's move, the gradient at ``w + e``
    less ``alpha`` times ``g``'s part orthogonal to it, ``rho`` following the learning rate
    between ``rho_min`` and ``rho``."""

    name = "gsam"
    combines = True
    one_process = True

    def __init__(
        self,
        rho: float = 0.05,
        alpha: float = 0.4,
        rho_min: float | None = None,
        lr_max: float | None = None,
        lr_min: float = 0.0,
    ):
        super().__init__(rho)
        self.alpha = in_range(f"transform {self.name!r}", "alpha", alpha, 0.0, high=1.0)
        self.lr_min = positive(self.name, "lr_min", lr_min)
        self.rho_min = None if rho_min is None else positive(self.name, "rho_min", rho_min, high=MAX_STEP)
        self.lr_max = None if lr_max is None else positive(self.name, "lr_max", lr_max)
        if (self.rho_min is None) != (self.lr_max is None):
            raise ValueError(
                f"transform {self.name!r}: rho follows the learning rate with both rho_min and lr_max "
                f"(rho at lr_max, rho_min at lr_min); got rho_min={rho_min!r}, lr_max={lr_max!r}"
            )
        if self.lr_max is not None and self.lr_max <= self.lr_min:
            raise ValueError(f"transform {self.name!r}: lr_max={lr_max!r} must be > lr_min={lr_min!r}")

    @property
    def needs_optimizer(self) -> str | None:
        return None if self.rho_min is None else "rho follows the learning rate (rho_min and lr_max)"

    def rho_at(self, lr: float | None) -> float:
        """``rho`` at the learning rate ``lr`` (``rho`` itself unless it follows the learning rate)."""
        if self.rho_min is None or self.lr_max is None or lr is None:
            return self.rho
        return self.rho_min + (self.rho - self.rho_min) * (lr - self.lr_min) / (self.lr_max - self.lr_min)

    def direction(self, params: list[Tensor], grads: list[Tensor], at: Ascent) -> tuple[list[Tensor], Tensor]:
        return sam_direction(self.rho_at(at.lr), grads, at)

    def combine(self, params: list[Tensor], first: list[Tensor], second: list[Tensor], at: Ascent) -> list[Tensor]:
        """``g_s - alpha v = (1 + alpha cos ||g|| / (||g_s|| + eps)) g_s - alpha g``, in place on ``g_s``."""
        if not self.alpha:
            return second
        norm_s, norm = global_norm(second), global_norm(first)
        cos = dot(first, second) / (norm_s * norm + EPS)
        torch._foreach_mul_(second, 1 + self.alpha * cos * norm / (norm_s + EPS))
        torch._foreach_add_(second, first, alpha=-self.alpha)
        return second
