"""The sharpness transforms: how far, and which way, a rule moves its parameters before the
second forward and backward.

* ``sam`` (Foret et al., 2021): ``e = rho g / ||g||``.
* ``asam`` (Kwon et al., 2021): with ``T = |w| + eta`` element-wise,
  ``e = rho T^2 g / ||T g||``. ``eta = 0`` (the default) is the form of davda54/sam and of
  pytorch-optimizer's ``SAM(adaptive=True)``; SamsungLabs' reference uses ``eta = 0.01`` on
  the weights only, which is a rule with ``params: "*weight"``.

``g`` is the first pass's gradient of the rule's parameters and ``||.||`` the L2 norm over
all of them together: each rule has its own norm and ``rho``. As in both references, 1e-12
is added to the norm so that a zero gradient gives a zero perturbation, not NaN.
``every: n`` perturbs on optimizer steps ``t`` (counted from 0) with ``(t + 1) % n == 0``
and lets the others be plain steps (one forward and backward).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from gradmod.hooks.validators import positive

EPS = 1e-12  # added to the norm, as davda54/sam and pytorch-optimizer do


def _every(transform: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"transform {transform!r}: every={value!r} must be an integer >= 1 (optimizer steps)")
    return value


class Perturbation:
    """Base of the sharpness transforms: ``direction(params, grads)`` returns ``(d, scale)``
    with ``e = scale * d`` per parameter (``d`` may reuse the ``grads`` tensors, which it
    owns; ``scale`` is a device scalar, so that no host read happens)."""

    name = "sharpness"

    def __init__(self, rho: float, every: int = 1):
        self.rho = positive(self.name, "rho", rho)
        self.every = _every(self.name, every)

    def due(self, step: int) -> bool:
        """Whether optimizer step ``step`` (0 for the first) takes two passes."""
        return (step + 1) % self.every == 0

    def direction(self, params: list[Tensor], grads: list[Tensor]) -> tuple[list[Tensor], Tensor]:
        raise NotImplementedError

    def __call__(self, grad: Tensor) -> Tensor | None:
        raise TypeError(
            f"{self.name!r} is a sharpness transform: it perturbs all of a rule's parameters "
            "before a second forward and backward (HookSet.backward(loss, closure=fn)), not one gradient"
        )


def _global_norm(tensors: list[Tensor]) -> Tensor:
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(tensors)))


class Sam(Perturbation):
    """``e = rho g / (||g|| + 1e-12)`` over the rule's parameters."""

    name = "sam"

    def direction(self, params: list[Tensor], grads: list[Tensor]) -> tuple[list[Tensor], Tensor]:
        return grads, self.rho / (_global_norm(grads) + EPS)


class Asam(Perturbation):
    """``e = rho T^2 g / (||T g|| + 1e-12)`` with ``T = |w| + eta``, over the rule's parameters."""

    name = "asam"

    def __init__(self, rho: float, eta: float = 0.0, every: int = 1):
        super().__init__(rho, every)
        self.eta = positive(self.name, "eta", eta)

    def direction(self, params: list[Tensor], grads: list[Tensor]) -> tuple[list[Tensor], Tensor]:
        t = torch._foreach_abs(params)
        if self.eta:
            torch._foreach_add_(t, self.eta)
        torch._foreach_mul_(grads, t)  # T g
        scale = self.rho / (_global_norm(grads) + EPS)
        torch._foreach_mul_(grads, t)  # T^2 g
        return grads, scale
