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


def register(name: str, factory: Callable[..., Transform] | None = None, *,
             foreach: Callable[..., Foreach] | None = None, overwrite: bool = False):
    """Register ``factory(**args) -> transform`` under ``name``; usable as a decorator.

    ``foreach(**args)`` optionally returns an in-place function over a list of gradients
    for the ``fused`` stage. A name is registered once unless ``overwrite=True``.
    """

    def add(f):
        if name in _FACTORIES and not overwrite:
            raise ValueError(f"transform {name!r} is already registered; pass overwrite=True to replace it")
        _FACTORIES[name] = f
        _FOREACH.pop(name, None)
        if foreach is not None:
            _FOREACH[name] = foreach
        return f

    return add(factory) if factory is not None else add


def names() -> list[str]:
    """The registered transform names."""
    return sorted(_FACTORIES)


@dataclass(frozen=True)
class Step:
    """One configured transform: its name, arguments and function."""

    name: str
    args: dict[str, Any] = field(default_factory=dict)
    fn: Transform = field(default=None, repr=False, compare=False)

    def __call__(self, grad: Tensor) -> Tensor | None:
        return self.fn(grad)

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
        raise ValueError(f"unknown transform {name!r}; allowed: {', '.join(names())}")
    params = inspect.signature(factory).parameters
    unknown = [k for k in args if k not in params]
    if unknown:
        allowed = ", ".join(params) or "no arguments"
        raise ValueError(f"transform {name!r} got unknown argument(s) {', '.join(unknown)}; allowed: {allowed}")
    missing = [k for k, p in params.items() if p.default is inspect.Parameter.empty and k not in args]
    if missing:
        raise ValueError(f"transform {name!r} needs argument(s) {', '.join(missing)}")
    return Step(name, args, factory(**args))


def _number(transform: str, arg: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ValueError(f"transform {transform!r}: {arg}={value!r} must be a number")
    return float(value)


def _positive(transform: str, arg: str, value: Any, *, allow_zero: bool = True) -> float:
    v = _number(transform, arg, value)
    if v < 0 or (v == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"transform {transform!r}: {arg}={value!r} must be {bound}")
    return v


# --- value transforms ------------------------------------------------------------------


def _clamp_bounds(min: float | None, max: float | None) -> tuple[float | None, float | None]:
    lo = None if min is None else _number("clamp", "min", min)
    hi = None if max is None else _number("clamp", "max", max)
    if lo is None and hi is None:
        raise ValueError("transform 'clamp' needs min, max or both")
    if lo is not None and hi is not None and lo > hi:
        raise ValueError(f"transform 'clamp': min={min} is greater than max={max}; need min <= max")
    return lo, hi


def clamp(min: float | None = None, max: float | None = None) -> Transform:
    lo, hi = _clamp_bounds(min, max)
    return lambda grad: grad.clamp(lo, hi)


def _clamp_foreach(min: float | None = None, max: float | None = None) -> Foreach:
    lo, hi = _clamp_bounds(min, max)

    def apply(grads: list[Tensor]) -> None:
        if lo is not None:
            torch._foreach_clamp_min_(grads, lo)
        if hi is not None:
            torch._foreach_clamp_max_(grads, hi)

    return apply


def zero() -> Transform:
    return torch.zeros_like


def min_zero() -> Transform:
    return lambda grad: grad.clamp(min=0)


def scale(factor: float) -> Transform:
    f = _number("scale", "factor", factor)
    return lambda grad: grad * f


def sign() -> Transform:
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


# --- observation -----------------------------------------------------------------------


class GradStats:
    """The ``log`` transform: statistics of every gradient it sees, accumulated on the
    gradient's device so that observing costs no host sync. ``read()`` syncs once.

    Per window (the calls since the last read): mean L2 norm, smallest and largest value,
    mean of the means, mean fraction of negative entries, total count of non-finite
    entries, and ``any_negative`` (the articles' "are there gradients below zero?").

    A ``post`` observer paired with the ``pre`` observer of the same rule (``log`` first
    and last in its chain) also reports ``frac_clipped``: the mean fraction of elements
    that the transforms between them changed (for ``clamp``: the elements clipped to a
    bound). ``pre`` keeps a reference to the gradient it saw until ``post`` compares.

    With ``histogram`` set (the trainer sets it for the step before a read), the call
    also bins the gradient on the device; the last such call's histogram is read with
    the window.
    """

    FIELDS = ("norm", "min", "max", "mean", "frac_negative", "nonfinite", "frac_clipped")
    BINS = 30
    COMPACT_AT = 256  # pending rows folded into one on the device, so memory stays bounded

    def __init__(self, label: str | None = None):
        self.label = label
        self.calls = 0
        self._rows: list[Tensor] = []  # per call (or folded window): FIELDS, as sums except min and max
        self._zero: Tensor | None = None  # frac_clipped of an unpaired call
        self.pre: GradStats | None = None  # set on a ``post`` observer: its ``pre`` partner
        self.keep: str | None = None  # on a ``pre`` observer: "ref", or "clone" where grads change in place
        self._seen: Tensor | None = None
        self.histogram = False
        self._hist: Tensor | None = None

    def __call__(self, grad: Tensor) -> None:
        # About 9 kernels per unpaired call (was 27 ops): aminmax is one pass, isnan(g * 0)
        # flags inf and nan (isfinite decomposes into four ops), and nothing is summed
        # here: rows are kept and reduced when read.
        g = grad.detach()
        gf = g.float()
        if self.pre is not None and self.pre._seen is not None:
            before, self.pre._seen = self.pre._seen, None
            changed = (g != before) & ~(g.isnan() & before.isnan())
            clipped = changed.mean(dtype=torch.float32)
        else:
            if self._zero is None or self._zero.device != g.device:
                self._zero = torch.zeros((), device=g.device)
            clipped = self._zero
        if self.keep is not None:
            self._seen = g.clone() if self.keep == "clone" else g
        lo, hi = torch.aminmax(gf)
        self._rows.append(torch.stack([
            torch.linalg.vector_norm(gf), lo, hi, gf.mean(),
            (gf < 0).mean(dtype=torch.float32), (gf * 0).isnan().sum(), clipped,
        ]))
        if self.histogram:
            self._hist = self.bin(gf)
        self.calls += 1
        if len(self._rows) >= self.COMPACT_AT:
            self._rows = [self._fold()]
        return None

    @property
    def _sum(self) -> Tensor | None:
        """The pending window as one row (None when empty)."""
        return self._fold() if self._rows else None

    def state_dict(self) -> dict[str, Any]:
        """The window in progress (calls and its row), for checkpoints."""
        return {"calls": self.calls, "window": self._sum}

    def load_state_dict(self, state: Mapping[str, Any], device: torch.device | None = None) -> None:
        """Continue the saved window; ``device``: where this run's gradients are."""
        window = state["window"]
        self.calls = state["calls"]
        self._rows = [] if window is None else [window if device is None else window.to(device)]

    def _fold(self) -> Tensor:
        """The pending rows as one row: sums, except min (column 1) and max (column 2)."""
        if len(self._rows) == 1:
            return self._rows[0]
        out = self._rows[0]
        for row in self._rows[1:]:  # left to right, so folding in pieces (a resume) gives the same bits
            out = out + row
        rows = torch.stack(self._rows)
        out[1:3] = torch.stack([rows[:, 1].min(), rows[:, 2].max()])
        return out

    @classmethod
    def bin(cls, g: Tensor) -> Tensor:
        """[min, max, count, sum, sum of squares, BINS counts] of the finite entries, on
        the device: equal-width bins over [min, max] (scatter_add, not histc or bincount,
        which read the range or the size back to the host on CUDA)."""
        g = g.flatten()
        finite = torch.isfinite(g)
        lo = torch.where(finite, g, math.inf).min()
        hi = torch.where(finite, g, -math.inf).max()
        width = (hi - lo).clamp_min(torch.finfo(g.dtype).tiny)
        idx = ((g - lo) / width * cls.BINS).floor().clamp(0, cls.BINS - 1)
        idx = torch.where(finite, idx, 0).long()
        counts = torch.zeros(cls.BINS, device=g.device).scatter_add_(0, idx, finite.float())
        vals = torch.where(finite, g, 0)
        head = torch.stack([lo, hi, finite.sum().float(), vals.sum(), (vals * vals).sum()])
        return torch.cat([head, counts])

    def take(self) -> tuple[int, Tensor | None]:
        """The pending window (calls, device tensor) and a fresh start; no sync. The
        tensor is the FIELDS, then ``bin()``'s values when a histogram was taken."""
        acc = self._fold() if self._rows else None
        out = acc if self._hist is None or acc is None else torch.cat([acc, self._hist])
        calls = self.calls
        self.calls, self._rows, self._hist = 0, [], None
        return calls, out

    @staticmethod
    def summarize(calls: int, values: list[float], paired: bool = False) -> dict[str, Any]:
        norm, lo, hi, mean, neg, nonfinite, clipped = values[:7]
        out = {
            "norm": norm / calls, "min": lo, "max": hi, "mean": mean / calls,
            "frac_negative": neg / calls, "nonfinite": int(nonfinite),
            "any_negative": bool(lo < 0), "calls": calls,
        }
        if paired:
            out["frac_clipped"] = clipped / calls
        if len(values) > 7 and values[9] > 0:  # a histogram of at least one finite entry
            h_lo, h_hi, num, total, squares = values[7:12]
            counts = values[12:]
            width = h_hi - h_lo if h_hi > h_lo else max(abs(h_lo), 1.0) * 1e-6
            out["histogram"] = {
                "min": h_lo, "max": h_hi, "num": int(num), "sum": total, "sum_squares": squares,
                "bucket_limits": [h_lo + width * (k + 1) / len(counts) for k in range(len(counts))],
                "bucket_counts": counts,
            }
        return out

    def read(self) -> dict[str, Any] | None:
        calls, acc = self.take()
        return None if acc is None else self.summarize(calls, acc.tolist(), self.pre is not None)


def log(label: str | None = None) -> Transform:
    return GradStats(label)


register("log", log)
