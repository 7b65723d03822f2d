"""The sharpness transforms: how far, and which way, a rule moves its parameters before the
second forward and backward, and what the rule's gradient is made of after it.

* ``sam`` (Foret et al., 2021): ``e = rho g / ||g||``.
* ``asam`` (Kwon et al., 2021): with ``T = |w| + eta`` element-wise,
  ``e = rho T^2 g / ||T g||``. ``eta = 0`` (the default) is the form of davda54/sam and of
  pytorch-optimizer's ``SAM(adaptive=True)``; SamsungLabs' reference uses ``eta = 0.01`` on
  the weights only, which is a rule with ``params: "*weight"``.
* ``gsam``, ``wsam``, ``looksam``, ``friendly_sam``: their own modules beside this one.

``g`` is the first pass's gradient of the rule's parameters and ``||.||`` the L2 norm over
all of them together: each rule has its own norm and ``rho``. As in both references, 1e-12
is added to the norm so that a zero gradient gives a zero perturbation, not NaN.
``every: n`` perturbs on optimizer steps ``t`` (counted from 0) with ``(t + 1) % n == 0``
and lets the others be plain steps (one forward and backward).

The transforms of a rule before its sharpness transform (``centralize``) shape ``g`` in
place once its norm is taken: the size of the move is the first pass's, its direction
theirs, as pytorch-optimizer's ``SAM(use_gc=True)`` does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Mapping

import torch
from torch import Tensor

from gradmod.hooks.validators import MAX_STEP, count, positive

EPS = 1e-12  # added to the norm, as davda54/sam and pytorch-optimizer do


def _every(transform: str, value: Any) -> int:
    """Every how many optimizer steps the transform perturbs: a whole number >= 1."""
    return count(f"transform {transform!r}", "every", value, 1, math.inf)


def _unbent(grads: list[Tensor]) -> None:
    """No transform before the sharpness one: ``g`` as the first pass gave it."""


@dataclass
class Ascent:
    """What a rule's transform reads on one micro-batch: ``step``, the optimizer steps
    finished; ``lr``, the learning rate the optimizer steps the rule's first parameter with
    (``SharpnessStage.set_optimizer``), None where no optimizer was handed over; ``bend``,
    the rule's transforms before the sharpness one, in place on ``g``; ``first``, the first
    micro-batch of the optimizer step; ``scale``, GradScaler's loss scale of this backward
    (fp16), or None."""

    step: int = 0
    lr: float | None = None
    bend: Callable[[list[Tensor]], None] = _unbent
    first: bool = True
    scale: Tensor | None = None


class Perturbation:
    """Base of the sharpness transforms: ``direction(params, grads, at)`` returns ``(d, scale)``
    with ``e = scale * d`` per parameter (``d`` may reuse the ``grads`` tensors, which it
    owns; ``scale`` is a device scalar, so that no host read happens).

    A transform that ``combines`` makes the rule's gradient of a micro-batch from both
    passes' (``combine``); one that ``corrects`` changes the gradient of a step that is not
    due (``correct``). ``one_process``: it combines gradients that DDP would average
    in between, or keeps state per rank. ``stateful``: it keeps tensors from step to step
    (``state_dict``)."""

    name = "sharpness"
    combines: ClassVar[bool] = False
    corrects: ClassVar[bool] = False
    one_process: ClassVar[bool] = False
    stateful: ClassVar[bool] = False

    def __init__(self, rho: float, every: int = 1):
        self.rho = positive(self.name, "rho", rho, high=MAX_STEP)
        self.every = _every(self.name, every)

    def due(self, step: int) -> bool:
        """Whether optimizer step ``step`` (0 for the first) takes two passes."""
        return (step + 1) % self.every == 0

    @property
    def needs_optimizer(self) -> str | None:
        """What this transform reads from the optimizer, or None if nothing."""
        return None

    def direction(self, params: list[Tensor], grads: list[Tensor], at: Ascent) -> tuple[list[Tensor], Tensor]:
        raise NotImplementedError

    def combine(self, params: list[Tensor], first: list[Tensor], second: list[Tensor], at: Ascent) -> list[Tensor]:
        """The rule's gradient of this micro-batch from ``g`` (``first``) and the gradient at
        ``w + e`` (``second``); both are the transform's to reuse."""
        return second

    def correct(self, params: list[Tensor], grads: list[Tensor], at: Ascent) -> None:
        """On a step that is not due: change this micro-batch's gradient in place."""

    def after_step(self, groups: list[dict[str, Any]]) -> None:
        """After ``optimizer.step()`` (``groups``: the optimizer's parameter groups)."""

    def state_dict(self, names: Mapping[Tensor, str]) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any], params: Mapping[str, Tensor]) -> None:  # noqa: B027
        """Restore ``state_dict()``'s tensors onto ``params`` (by name)."""

    def __call__(self, grad: Tensor) -> Tensor | None:
        raise TypeError(
            f"{self.name!r} is a sharpness transform: it perturbs all of a rule's parameters "
            "before a second forward and backward (HookSet.backward(loss, closure=fn)), not one gradient"
        )


def global_norm(tensors: list[Tensor]) -> Tensor:
    """The L2 norm of ``tensors`` together, on the device."""
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(tensors)))


def sam_direction(rho: float | Tensor, grads: list[Tensor], at: Ascent) -> tuple[list[Tensor], Tensor]:
    """SAM's ascent: ``grads`` (bent as ``at`` says, in place) and ``rho / (||g|| + 1e-12)``, the
    norm taken before the bend; the move of sam and of the variants that change only its rho,
    its combination or its gradient."""
    scale = rho / (global_norm(grads) + EPS)
    at.bend(grads)
    return grads, scale


class Sam(Perturbation):
    """SAM (Foret et al. 2021; pytorch-optimizer's SAM): ``e = rho g / (||g|| + 1e-12)`` over the
    rule's parameters."""

    name = "sam"

    def direction(self, params: list[Tensor], grads: list[Tensor], at: Ascent) -> tuple[list[Tensor], Tensor]:
        return sam_direction(self.rho, grads, at)


class Asam(Perturbation):
    """ASAM (Kwon et al. 2021; pytorch-optimizer's SAM(adaptive=True)): ``e = rho T^2 g / (||T g||
    + 1e-12)`` with ``T = |w| + eta``, over the rule's parameters."""

    name = "asam"

    def __init__(self, rho: float, eta: float = 0.0, every: int = 1):
        super().__init__(rho, every)
        self.eta = positive(self.name, "eta", eta, high=MAX_STEP)

    def direction(self, params: list[Tensor], grads: list[Tensor], at: Ascent) -> tuple[list[Tensor], Tensor]:
        t = torch._foreach_abs(params)
        if self.eta:
            torch._foreach_add_(t, self.eta)
        if at.bend is _unbent:
            torch._foreach_mul_(grads, t)  # T g
            scale = self.rho / (global_norm(grads) + EPS)
            torch._foreach_mul_(grads, t)  # T^2 g
            return grads, scale
        scale = self.rho / (global_norm(torch._foreach_mul(grads, t)) + EPS)  # ||T g|| before the bend
        at.bend(grads)
        torch._foreach_mul_(t, t)
        torch._foreach_mul_(grads, t)
        return grads, scale
