"""What the per_sample stage learns from the model's first training forward, before it runs.

Two extra forwards of the same inputs (the random state restored after them): one with the
batch as given, recording for every parameter of a per_sample rule the modules whose
forwards were running when an operation used it; one with the batch grown by one example.
A tensor dimension whose size changed with the batch is that call's batch dimension: known,
not guessed from sizes (a sequence as long as the batch is large stays put). A dimension
that holds the batch merged with another, or two that both changed, is marked ``UNKNOWN``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

UNKNOWN = "?"


@dataclass
class CallShapes:
    """One module call: the shapes of its tensor inputs (the ``(args, kwargs)`` tree) and outputs."""

    spec: Any  # the (args, kwargs) tree with each tensor leaf replaced by its shape, else None
    outs: list[torch.Size] = field(default_factory=list)


@dataclass
class Trace:
    batch: int
    dims: dict[int, tuple[Any, list]]  # id(module) -> (input dims tree, output dims) or UNKNOWN
    uses: dict[int, list[tuple[nn.Module, ...]]]  # id(param) -> each use's stack of running modules


def _shape(x: Any) -> Any:
    return x.shape if isinstance(x, Tensor) else None


def _tensors(out: Any) -> list[Tensor]:
    return [t for t in pytree.tree_leaves(out) if isinstance(t, Tensor)]


class _Uses(TorchFunctionMode):
    """Each operation that takes a watched parameter and gives a tensor autograd connects to it."""

    def __init__(self, watched: set[int], stack: list, uses: dict):
        super().__init__()
        self.watched, self.stack, self.uses = watched, stack, uses

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        used = {id(x) for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, Tensor)} & self.watched
        if used and any(t.grad_fn is not None for t in _tensors(out)):
            for p in used:
                self.uses.setdefault(p, []).append(tuple(self.stack))
        return out


def _record(model: nn.Module, args, kwargs, watched: set[int] | None) -> tuple[dict[int, list[CallShapes]], dict]:
    calls: dict[int, list[CallShapes]] = {}
    stack: list[nn.Module] = []
    open_calls: list[CallShapes] = []
    uses: dict[int, list] = {}

    def pre(m, a, kw):
        stack.append(m)
        call = CallShapes(pytree.tree_map(_shape, (a, kw)))
        calls.setdefault(id(m), []).append(call)
        open_calls.append(call)

    def post(m, a, kw, out):
        stack.pop()
        open_calls.pop().outs = [t.shape for t in _tensors(out)]

    modules = {id(m): m for m in model.modules()}.values()
    handles = [
        h
        for m in modules
        for h in (m.register_forward_pre_hook(pre, with_kwargs=True), m.register_forward_hook(post, with_kwargs=True))
    ]
    try:
        if watched is None:
            with torch.no_grad():
                model(*args, **kwargs)
        else:
            with torch.enable_grad(), _Uses(watched, stack, uses):
                model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return calls, uses


def _dim(a: torch.Size | None, b: torch.Size | None, batch: int):
    if a is None:
        return None
    if b is None or len(a) != len(b):
        return UNKNOWN
    changed = [d for d in range(len(a)) if a[d] != b[d]]
    if not changed:
        return None
    d = changed[0]
    return d if len(changed) == 1 and a[d] == batch and b[d] == batch + 1 else UNKNOWN


def _dims(first: list[CallShapes], grown: list[CallShapes] | None, batch: int):
    """One module's dims, the same for all its calls, else UNKNOWN."""
    if grown is None or len(first) != len(grown):
        return UNKNOWN
    found = []
    for c1, c2 in zip(first, grown):
        leaves1, tree1 = pytree.tree_flatten(c1.spec, is_leaf=lambda x: isinstance(x, torch.Size))
        leaves2, tree2 = pytree.tree_flatten(c2.spec, is_leaf=lambda x: isinstance(x, torch.Size))
        if tree1 != tree2 or len(c1.outs) != len(c2.outs):
            return UNKNOWN
        ins = pytree.tree_unflatten([_dim(x, y, batch) for x, y in zip(leaves1, leaves2)], tree1)
        found.append((ins, [_dim(x, y, batch) for x, y in zip(c1.outs, c2.outs)]))
    return found[0] if all(f == found[0] for f in found) else UNKNOWN


def batch_dim(model: nn.Module) -> int:
    """The batch dimension of the model's own inputs: 0, or 1 for a sequence-first torch layer."""
    return 1 if getattr(model, "batch_first", True) is False else 0


def _grow(x: Any, d: int, batch: int) -> Any:
    if isinstance(x, Tensor) and x.dim() > d and x.shape[d] == batch:
        return torch.cat([x, x.narrow(d, 0, 1)], d)
    return x


def trace(model: nn.Module, args: tuple, kwargs: dict, watched: set[int]) -> Trace | None:
    """The trace of one forward of ``model(*args, **kwargs)``; None when no input has a batch."""
    d = batch_dim(model)
    first = next((x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, Tensor) and x.dim() > d), None)
    if first is None:
        return None
    batch = first.shape[d]
    devices = [x.device for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, Tensor) and x.is_cuda]
    with torch.random.fork_rng(devices=sorted({x.index or 0 for x in devices})):
        calls, uses = _record(model, args, kwargs, watched)
        grown_args, grown_kwargs = pytree.tree_map(lambda x: _grow(x, d, batch), (args, kwargs))
        grown, _ = _record(model, grown_args, grown_kwargs, None)
    dims = {m: _dims(c, grown.get(m), batch) for m, c in calls.items()}
    return Trace(batch, dims, uses)


def detach_input(x: Any, dtype: torch.dtype | None = None) -> Any:
    """``x`` out of the graph; a floating tensor in ``dtype`` (autocast's bf16 inputs)."""
    if not isinstance(x, Tensor):
        return x
    x = x.detach()
    return x.to(dtype) if dtype is not None and x.is_floating_point() and x.dtype != dtype else x


def param_or_none(model: nn.Module, name: str) -> Tensor | None:
    try:
        return model.get_parameter(name)
    except AttributeError:
        return None


def followed_forward() -> bool:
    """A forward worth following: gradients on, and no torch.func transform (ours replaying
    a module, or the user's) running it."""
    return torch.is_grad_enabled() and not torch._C._are_functorch_transforms_active()
