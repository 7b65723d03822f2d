"""Clipped weights out of autograd's graph where the stage forms their gradients itself.

Autograd computes each layer's batch weight gradient, which the per_sample stage drops for its
clipped sum: for a convolution about half of its backward. After the first backward (whose
whole gradients check every form against autograd's), a followed Linear, convolution, Conv1D
or Embedding, and attention's projections (``attention.follow``), run on detached aliases of
their clipped weights: the output gradient the stage needs is still computed (an output that
would leave the graph, its input being the data or token ids, becomes a leaf of its own), the
weight gradient is not. A gradient that still reaches such a weight came from a use the
stage does not follow: refused in one line (``accounts.refuse_arrivals``; a probe along one
direction could miss a use that repeats a followed call).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor, nn


def swap(module: nn.Module, names: dict[str, Tensor], ids: set[int]) -> tuple[dict[str, Tensor], list]:
    """``module``'s parameters (local, possibly dotted names) whose ids are in ``ids`` replaced
    by detached aliases: the names with what now stands for them, and what ``restore`` undoes."""
    now, swapped = dict(names), []
    for n, p in names.items():
        if id(p) in ids:
            owner_name, _, attr = n.rpartition(".")
            owner = module.get_submodule(owner_name)
            now[n] = owner._parameters[attr] = p.detach()
            swapped.append((owner, attr, p))
    return now, swapped


def restore(swapped: list) -> None:
    for owner, attr, p in swapped:
        owner._parameters[attr] = p


def in_graph(output: Any) -> Any:
    """A tensor output that left the graph (its input was data or token ids) hanging from a leaf
    of its own that takes a gradient (cloned: in-place operations on the output stay allowed)."""
    if isinstance(output, Tensor) and output.is_floating_point() and not output.requires_grad:
        return output.detach().requires_grad_().clone()
    return None


def detach_during(module: nn.Module, names: dict[str, Tensor], ids: Callable[[], set[int]]) -> list:
    """Hooks that run ``module``'s forward on detached aliases of those of ``names`` in ``ids()``
    (empty: none), ahead of any other forward hook (so the stage sees the output in the graph);
    the parameters are back when the forward ends, also by an error."""
    open_: list[list] = []

    def pre(m: nn.Module, args: tuple) -> None:
        while open_:  # a forward that raised left its parameters swapped
            restore(open_.pop())
        chosen = ids()
        if chosen:
            open_.append(swap(m, names, chosen)[1])

    def post(m: nn.Module, args: tuple, output: Any) -> Any:
        if not open_:
            return None
        restore(open_.pop())
        return in_graph(output)

    return [module.register_forward_pre_hook(pre), module.register_forward_hook(post, prepend=True, always_call=True)]


def detachable(layers: list) -> set[int]:
    """The parameters that may run detached after the first backward: every layer holding one
    says so (``Form.detaches``: convolutions, Linear, Conv1D, Embedding; or records its calls:
    attention) and none is called on one row for the whole batch. Tied weights (an embedding
    and its output layer) too, when both are such layers."""
    held: dict[int, list] = {}
    for layer in layers:
        for p in layer.names.values():
            held.setdefault(id(p), []).append(layer)
    ok = lambda x: (x.form.detaches or x.form.captures) and not x.broadcast  # noqa: E731
    return {i for i, holders in held.items() if all(ok(x) for x in holders)}
