"""Weights out of autograd's graph where the stage forms their gradients itself.

Autograd computes each layer's batch weight gradient, which the per_sample stage drops for its
clipped sum: for a convolution about half of its backward. After the first backward (whose
whole gradients check every form against autograd's), a followed Linear, convolution, Conv1D
or Embedding, and attention's projections (``attention.follow``), run on detached aliases of
their clipped weights: the output gradient the stage needs is still computed (an output that
would leave the graph, its input being the data or token ids, becomes a leaf of its own), the
weight gradient is not. A gradient that still reaches such a weight came from a use the
stage does not follow: refused in one line (``accounts.refuse_arrivals``; a probe along one
direction could miss a use that repeats a followed call).

A weight whose rule keeps autograd's gradient (``scores``, ``log``) runs detached too, its
layer's output hung from it by ``hang``: in the backward the call gives its gradient, the sum
of the per-example ones where the layer forms them anyway (autograd's batch weight gradient is
then not computed besides), else the batch's, as autograd would. It is delivered through
autograd like any other (tensor hooks, DDP's reducer and accumulation see it as usual); where
nothing else reached the weight, autograd hands its hook that very tensor, and the probe check
of that backward is spared (``accounts.Probed.arrived``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
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


def detach_during(
    module: nn.Module,
    names: dict[str, Tensor],
    ids: Callable[[], set[int]],
    then: Callable[[list[Tensor]], None] | None = None,
) -> list:
    """Hooks that run ``module``'s forward on detached aliases of those of ``names`` in ``ids()``
    (empty: none), ahead of any other forward hook (so the stage sees the output in the graph);
    the parameters are back when the forward ends, also by an error. ``then``: told which
    ran detached, to ``hang`` the output from them (else it is put back in the graph as a leaf)."""
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
        swapped = open_.pop()
        restore(swapped)
        if then is None:
            return in_graph(output)
        then([p for _, _, p in swapped])
        return None

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


class _Hung(torch.autograd.Function):
    """``out`` itself (rebased, as by an in-place operation: later in-place ones stay allowed),
    now also a function of ``params``, whose gradients are ``sums(grad)``: formed without a
    graph, so a backward that would build one (``create_graph=True``) is refused."""

    @staticmethod
    def forward(ctx, sums, out, *params):
        ctx.sums = sums
        ctx.mark_dirty(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        if torch.is_grad_enabled():
            raise ValueError(
                "per_sample: backward(create_graph=True) after the first step: a rule that keeps "
                "autograd's gradient (scores, log) forms its layers' weight gradients without a graph; "
                "call backward without create_graph, or take the second-order term outside such a rule"
            )
        return None, grad, *ctx.sums(grad)


def formed_sums(call: Any, params: list[Tensor], gave: Callable[[Tensor, Tensor], None]) -> Callable:
    """A hung call's (``assign.Call``) parameters' gradients from its output gradient, each
    told to ``gave``: where the layer forms per-example ones, their sums (the per-example ones
    kept on the call for the end of the backward), else the batch's, as autograd computes it."""
    layer = call.layer
    order = [next(n for n, p in layer.names.items() if p is q) for q in params]

    def sums(grad: Tensor) -> list[Tensor]:
        m, b = layer.module, grad.detach().to(params[0].dtype).movedim(layer.out_dims[0], 0)
        if layer.form.materialises(m, call.inputs, b):
            call.formed = layer.form.per_example(m, call.inputs, b, set(order))
            got = {n: g.sum(0) for n, g in call.formed.items()}
        else:
            got = layer.form.weighted(m, call.inputs, b, b.new_ones(len(b)), set(order))
        out = [got[n].to(q.dtype) for n, q in zip(order, params)]
        for q, g in zip(params, out):
            gave(q, g)
        return out

    return sums


def hang(out: Tensor, params: list[Tensor], sums: Callable[[Tensor], list[Tensor]]) -> None:
    """``out``, computed from detached aliases of ``params``, hung from them in place: its
    gradient passes through, and ``sums(its gradient)`` are theirs (one per parameter)."""
    _Hung.apply(sums, out, *params)
