"""The element-wise transforms: plain functions ``grad -> Tensor | None``, registered by name.

A *factory* takes the transform's arguments and returns the function, so a config
entry ``{name: clamp, min: -0.01, max: 0.01}`` becomes ``clamp(min=-0.01, max=0.01)``
(the registry of every kind is ``gradmod.hooks.registry``).
Transforms never modify ``grad`` in place (the tensor-hook contract); returning ``None``
leaves the gradient as it is (observers such as ``log`` do that).

Each transform may also have an in-place *foreach* form over a list of accumulated
``.grad`` tensors, used by the ``fused`` stage; without one, the fused stage calls the
plain function per tensor.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from gradmod.hooks.mesh import reductions as mesh
from gradmod.hooks.mesh.devices import loops_foreach
from gradmod.hooks.mesh.sharded import is_sharded
from gradmod.hooks.registry import OWN_TRANSFORMS, BuiltTransform, build, factory, names, parse_spec
from gradmod.hooks.stats.rows import BIG
from gradmod.hooks.validators import number, positive

__all__ = ["BuiltTransform", "OWN_TRANSFORMS", "build", "factory", "names", "parse_spec"]

Transform = Callable[[Tensor], "Tensor | None"]
Foreach = Callable[[list[Tensor]], None]


# --- value transforms ------------------------------------------------------------------


def _clamp_bounds(min: float | None, max: float | None, bound: float | None) -> tuple[float | None, float | None]:
    if bound is not None:
        if min is not None or max is not None:
            raise ValueError("transform 'clamp': give bound (the range [-bound, bound]) or min/max, not both")
        b = positive("clamp", "bound", bound)
        return -b, b
    lo = None if min is None else number("clamp", "min", min)
    hi = None if max is None else number("clamp", "max", max)
    if lo is None and hi is None:
        raise ValueError("transform 'clamp' needs bound, or min, max or both")
    if lo is not None and hi is not None and lo > hi:
        raise ValueError(f"transform 'clamp': min={min} is greater than max={max}; need min <= max")
    return lo, hi


def clamp(min: float | None = None, max: float | None = None, bound: float | None = None) -> Transform:
    """Clamp each element to [min, max] (either may be left out) or to [-bound, bound].

    ``bound`` alone is one number to tune for a symmetric clip."""
    lo, hi = _clamp_bounds(min, max, bound)
    return lambda grad: grad.clamp(lo, hi)


def clamp_foreach(min: float | None = None, max: float | None = None, bound: float | None = None) -> Foreach:
    lo, hi = _clamp_bounds(min, max, bound)

    def apply(grads: list[Tensor]) -> None:
        # On the CPU a foreach op is a loop of kernels anyway: a big tensor takes one pass of
        # its own, not two. On CUDA each foreach op is one launch for all tensors.
        if lo is not None and hi is not None and grads and loops_foreach(grads[0].device):
            big = [g for g in grads if g.numel() >= BIG]
            for g in big:
                g.clamp_(lo, hi)
            grads = [g for g in grads if g.numel() < BIG] if big else grads
        if lo is not None and grads:
            torch._foreach_clamp_min_(grads, lo)
        if hi is not None and grads:
            torch._foreach_clamp_max_(grads, hi)

    return apply


def zero() -> Transform:
    """Replace the gradient with zeros."""
    return torch.zeros_like


def zero_foreach() -> Foreach:
    return torch._foreach_zero_


def min_zero() -> Transform:
    """Drop negative elements: clamp(min=0)."""
    return lambda grad: grad.clamp(min=0)


def min_zero_foreach() -> Foreach:
    return lambda grads: torch._foreach_clamp_min_(grads, 0.0)


def scale(factor: float) -> Transform:
    """Multiply the gradient by ``factor``."""
    f = number("scale", "factor", factor)
    return lambda grad: grad * f


def scale_foreach(factor: float) -> Foreach:
    f = number("scale", "factor", factor)
    return lambda grads: torch._foreach_mul_(grads, f)


def sign() -> Transform:
    """Keep only the sign of each element (-1, 0, 1)."""
    return torch.sign


def sign_foreach() -> Foreach:
    return torch._foreach_sign_


def centralize() -> Transform:
    """Gradient centralisation: subtract the mean over all dims but the first (output units)."""

    def apply(grad: Tensor) -> Tensor:
        if grad.dim() < 2:
            return grad
        if is_sharded(grad):  # a row cut by tensor parallelism: its mean over the mesh
            return mesh.like(grad, mesh.local(grad) - mesh.row_means(grad))
        return grad - grad.mean(dim=tuple(range(1, grad.dim())), keepdim=True)

    return apply


def norm_clip(max_norm: float) -> Transform:
    """Rescale this tensor's gradient so its L2 norm is at most ``max_norm``."""
    m = positive("norm_clip", "max_norm", max_norm, allow_zero=False)

    def apply(grad: Tensor) -> Tensor:
        norm = mesh.mesh_norm([grad]) if is_sharded(grad) else torch.linalg.vector_norm(grad)
        # clamp_max keeps this on the device: no host sync to compare norm with m.
        coef = (m / (norm + 1e-6)).clamp_max(1.0)
        return mesh.like(grad, mesh.local(grad) * coef) if is_sharded(grad) else grad * coef

    return apply


class Noise:
    """Add Gaussian noise with std ``std / (1 + t) ** decay``, ``t`` the optimizer steps
    completed (annealed). The step clock sets ``t`` (``at_step``, at each
    ``HookSet.after_backward``), so every micro-batch of a step gets the same std and a
    resumed run continues the decay from its checkpoint's clock. On a DTensor each piece
    draws its own values (replicas of a piece the same ones)."""

    def __init__(self, std: float, decay: float = 0.55):
        self.std = positive("noise", "std", std)
        self.decay = positive("noise", "decay", decay)
        self.sigma = self.std  # at t = 0

    def at_step(self, t: int) -> None:
        self.sigma = self.std / (1 + t) ** self.decay

    def __call__(self, grad: Tensor) -> Tensor:
        if is_sharded(grad):
            # One seed from the global generator (the same on every rank seeded alike), then
            # each piece its own stream: pieces differ, replicas agree, a rerun repeats.
            seed = int(torch.randint(0, 1 << 62, (), dtype=torch.int64))
            piece = mesh.local(grad)
            drawn = torch.randn(piece.shape, generator=mesh.shard_generator(grad, seed), device=piece.device)
            return mesh.like(grad, piece + self.sigma * drawn.to(piece.dtype))
        return grad + self.sigma * torch.randn_like(grad)


noise = Noise
