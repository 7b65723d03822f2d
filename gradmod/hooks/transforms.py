"""Gradient transforms: plain functions ``grad -> Tensor | None``, registered by name.

A *factory* takes the transform's arguments and returns the function, so a config
entry ``{name: clamp, min: -0.01, max: 0.01}`` becomes ``clamp(min=-0.01, max=0.01)``.
Transforms never modify ``grad`` in place (the tensor-hook contract); returning ``None``
leaves the gradient as it is (observers such as ``log`` do that).

Each transform may also have an in-place *foreach* form over a list of accumulated
``.grad`` tensors, used by the ``fused`` stage; without one, the fused stage calls the
plain function per tensor.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable, Mapping

import torch
from torch import Tensor

Transform = Callable[[Tensor], "Tensor | None"]
Foreach = Callable[[list[Tensor]], None]

_FACTORIES: dict[str, Callable[..., Transform]] = {}
_FOREACH: dict[str, Callable[..., Foreach]] = {}
_GROUP: set[str] = set()  # names of group transforms (see gradmod.hooks.group)


def register(name: str, factory: Callable[..., Transform] | None = None, *,
             foreach: Callable[..., Foreach] | None = None, group: bool = False,
             overwrite: bool = False):
    """Register ``factory(**args) -> transform`` under ``name``; usable as a decorator.

    ``foreach(**args)`` optionally returns an in-place function over a list of gradients
    for the ``fused`` stage. ``group=True``: the factory builds a group transform, one per
    rule, that acts on all the rule's gradients together (fused stage only; see
    ``gradmod.hooks.group``). A name is registered once unless ``overwrite=True``.
    Bad arguments fail here, not when a rule is attached.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"transforms.register: name must be a non-empty str, got {name!r}")
    if factory is not None and not callable(factory):
        raise TypeError(f"transforms.register({name!r}): factory must be callable, got {type(factory).__name__}")
    if foreach is not None and not callable(foreach):
        raise TypeError(f"transforms.register({name!r}): foreach must be callable or None, got {type(foreach).__name__}")
    if group and foreach is not None:
        raise ValueError(f"transforms.register({name!r}): a group transform has no foreach form")

    def add(f):
        if not callable(f):
            raise TypeError(f"transforms.register({name!r}): factory must be callable, got {type(f).__name__}")
        if name in _FACTORIES and not overwrite:
            raise ValueError(f"transform {name!r} is already registered; pass overwrite=True to replace it")
        _FACTORIES[name] = f
        _FOREACH.pop(name, None)
        _GROUP.discard(name)
        if foreach is not None:
            _FOREACH[name] = foreach
        if group:
            _GROUP.add(name)
        return f

    return add(factory) if factory is not None else add


def is_group(name: str) -> bool:
    """Whether ``name`` is a group transform (acts on all of a rule's gradients together)."""
    return name in _GROUP


def names() -> list[str]:
    """The registered transform names."""
    return sorted(_FACTORIES)


# How a transform of one's own gets a name (train.py imports the modules named in plugins).
OWN_TRANSFORMS = ("a transform of your own is registered with transforms.register, "
                  "in a module given as plugins=[my_pkg.x]")


def factory(name: str) -> Callable[..., Transform]:
    """The factory registered under ``name`` (its signature lists the transform's arguments)."""
    if name not in _FACTORIES:
        raise ValueError(f"unknown transform {name!r}; allowed: {', '.join(names())}; {OWN_TRANSFORMS}")
    return _FACTORIES[name]


@dataclass(frozen=True)
class Step:
    """One configured transform: its name, arguments and function."""

    name: str
    args: dict[str, Any] = field(default_factory=dict)
    fn: Transform = field(default=None, repr=False, compare=False)

    def __call__(self, grad: Tensor) -> Tensor | None:
        return self.fn(grad)

    @property
    def group(self) -> bool:
        """A group transform: ``fn`` acts on all of a rule's gradients at the fused stage."""
        return is_group(self.name)

    @cached_property
    def inplace(self) -> Foreach | None:
        """The in-place foreach form, built once (the fused stage calls it every step)."""
        foreach = _FOREACH.get(self.name)
        return None if foreach is None else foreach(**self.args)

    def apply_(self, grads: list[Tensor]) -> None:
        """Apply in place to accumulated gradients (the fused stage)."""
        if self.inplace is not None:
            self.inplace(grads)
            return
        for g in grads:
            out = self.fn(g)
            if out is not None:
                g.copy_(out)

    def __str__(self) -> str:
        if not self.args:
            return self.name
        return f"{self.name}({', '.join(f'{k}={v}' for k, v in self.args.items())})"


def parse_spec(spec: str | Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """``"zero"`` or ``{"name": "clamp", "min": ..., "max": ...}`` -> (name, args)."""
    if isinstance(spec, str):
        return spec, {}
    if isinstance(spec, Mapping) and isinstance(spec.get("name"), str):
        args = {str(k): v for k, v in spec.items() if k != "name"}
        return spec["name"], args
    raise ValueError(f"a transform must be a name or a mapping with 'name' and its arguments, got {spec!r}")


def build(spec: str | Mapping[str, Any]) -> Step:
    """Build a transform from its config entry; bad names or arguments are a ValueError."""
    name, args = parse_spec(spec)
    factory = _FACTORIES.get(name)
    if factory is None:
        raise ValueError(f"unknown transform {name!r}; allowed: {', '.join(names())}; {OWN_TRANSFORMS}")
    params = inspect.signature(factory).parameters
    unknown = [k for k in args if k not in params]
    if unknown:
        allowed = ", ".join(params) or "no arguments"
        raise ValueError(f"transform {name!r} got unknown argument(s) {', '.join(unknown)}; allowed: {allowed}")
    missing = [k for k, p in params.items() if p.default is inspect.Parameter.empty and k not in args]
    if missing:
        raise ValueError(f"transform {name!r} needs argument(s) {', '.join(missing)}")
    return Step(name, args, factory(**args))


def _number(transform: str, arg: str, value: Any, *, finite: bool = True) -> float:
    """A transform's numeric argument; an infinite one only where the transform means it
    (a norm's order): elsewhere it can only make gradients non-finite or do nothing."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"transform {transform!r}: {arg}={value!r} must be a number")
    if math.isnan(value) or (finite and math.isinf(value)):
        raise ValueError(f"transform {transform!r}: {arg}={value!r} must be a {'finite ' if finite else ''}number")
    return float(value)


def _positive(transform: str, arg: str, value: Any, *, allow_zero: bool = True) -> float:
    v = _number(transform, arg, value)
    if v < 0 or (v == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"transform {transform!r}: {arg}={value!r} must be {bound}")
    return v


# --- value transforms ------------------------------------------------------------------


def _clamp_bounds(min: float | None, max: float | None, bound: float | None) -> tuple[float | None, float | None]:
    if bound is not None:
        if min is not None or max is not None:
            raise ValueError("transform 'clamp': give bound (the range [-bound, bound]) or min/max, not both")
        b = _positive("clamp", "bound", bound)
        return -b, b
    lo = None if min is None else _number("clamp", "min", min)
    hi = None if max is None else _number("clamp", "max", max)
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


def _clamp_foreach(min: float | None = None, max: float | None = None, bound: float | None = None) -> Foreach:
    lo, hi = _clamp_bounds(min, max, bound)

    def apply(grads: list[Tensor]) -> None:
        if lo is not None:
            torch._foreach_clamp_min_(grads, lo)
        if hi is not None:
            torch._foreach_clamp_max_(grads, hi)

    return apply


def zero() -> Transform:
    """Replace the gradient with zeros."""
    return torch.zeros_like


def min_zero() -> Transform:
    """Drop negative elements: clamp(min=0)."""
    return lambda grad: grad.clamp(min=0)


def scale(factor: float) -> Transform:
    """Multiply the gradient by ``factor``."""
    f = _number("scale", "factor", factor)
    return lambda grad: grad * f


def sign() -> Transform:
    """Keep only the sign of each element (-1, 0, 1)."""
    return torch.sign


def centralize() -> Transform:
    """Gradient centralisation: subtract the mean over all dims but the first (output units)."""

    def apply(grad: Tensor) -> Tensor:
        if grad.dim() < 2:
            return grad
        return grad - grad.mean(dim=tuple(range(1, grad.dim())), keepdim=True)

    return apply


def norm_clip(max_norm: float) -> Transform:
    """Rescale this tensor's gradient so its L2 norm is at most ``max_norm``."""
    m = _positive("norm_clip", "max_norm", max_norm, allow_zero=False)

    def apply(grad: Tensor) -> Tensor:
        norm = torch.linalg.vector_norm(grad)
        # clamp_max keeps this on the device: no host sync to compare norm with m.
        return grad * (m / (norm + 1e-6)).clamp_max(1.0)

    return apply


def noise(std: float, decay: float = 0.55) -> Transform:
    """Add Gaussian noise with std ``std / (1 + t) ** decay`` at call ``t`` (annealed)."""
    s = _positive("noise", "std", std)
    d = _positive("noise", "decay", decay)
    calls = 0

    def apply(grad: Tensor) -> Tensor:
        nonlocal calls
        sigma = s / (1 + calls) ** d
        calls += 1
        return grad + sigma * torch.randn_like(grad)

    return apply


register("clamp", clamp, foreach=_clamp_foreach)
register("zero", zero, foreach=lambda: torch._foreach_zero_)
register("min_zero", min_zero, foreach=lambda: lambda grads: torch._foreach_clamp_min_(grads, 0.0))
register("scale", scale, foreach=lambda factor: lambda grads: torch._foreach_mul_(grads, _number("scale", "factor", factor)))
register("sign", sign, foreach=lambda: torch._foreach_sign_)
register("centralize", centralize)
register("norm_clip", norm_clip)
register("noise", noise)
