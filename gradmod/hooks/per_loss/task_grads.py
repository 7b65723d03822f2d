"""Which of a per_loss rule's parameters may be answered from a layer's (input, output gradient)
pairs, from the trace of the model's first training forward (``gradmod.hooks.tracing.param_uses``),
and the k task gradients of the rest (``task_grads``).

A Linear with torch's own forward may be answered so only when every use of its weight
and bias ran inside its own forward and no other module holds them: not attention's
``out_proj`` (used inside ``F.multi_head_attention_forward``), not a weight also used through
``F.linear``, not a weight tied to another module. Every other parameter gets its k task
gradients directly from the batched backward.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import Tensor, nn

from gradmod.hooks.per_loss import gramian
from gradmod.hooks.per_loss.frontier import reached


def factored_forward(m: nn.Module) -> bool:
    """A Linear with torch's own forward (a subclass's forward may do anything)."""
    return isinstance(m, nn.Linear) and type(m).forward is nn.Linear.forward


def assign_layers(model: nn.Module, owner: dict[int, Any], uses: dict[int, list]) -> list[gramian.Layer]:
    """The layers answered from their calls; ``owner``: id(param) -> its gradient rule."""
    holders: dict[int, int] = {}
    for m in model.modules():
        for p in m.parameters(recurse=False):
            holders[id(p)] = holders.get(id(p), 0) + 1
    layers = []
    for m in model.modules():
        mine = {n: p for n, p in m.named_parameters(recurse=False) if id(p) in owner}
        if not mine or not factored_forward(m):
            continue
        rules = {id(owner[id(p)]) for p in mine.values()}
        inside = all(uses.get(id(p)) and all(s and s[-1] is m for s in uses[id(p)]) for p in mine.values())
        if len(rules) == 1 and inside and all(holders[id(p)] == 1 for p in mine.values()):
            layers.append(gramian.Layer(m, owner[id(next(iter(mine.values())))], set(mine)))
    return layers


def used_apart(losses: list[Tensor], layers: list[gramian.Layer], inside: list = ()) -> set[int]:
    """The ``layers`` (ids) whose weight or bias the losses reach other than through the
    layer's outputs of this step: a use outside the model's forward, which the trace cannot
    see (a penalty on the weight in a loss). Their rows' Gram would miss that part. The walk
    stops at the ``inside`` nodes (the model's outputs): below them the trace saw every use."""
    stops = {edge.node for layer in layers for _, edge in layer.calls} | set(inside)
    held = {id(getattr(layer.module, n)): id(layer) for layer in layers for n in layer.names}
    found: set[int] = set()
    seen, todo = set(), [loss.grad_fn for loss in losses if loss.grad_fn is not None]
    while todo:
        node = todo.pop()
        if node in seen or node in stops:
            continue
        seen.add(node)
        nexts = node.next_functions
        if nexts:
            todo += [nxt for nxt, _ in nexts if nxt is not None]
        elif (leaf := getattr(node, "variable", None)) is not None and id(leaf) in held:  # a gradient accumulator
            found.add(held[id(leaf)])
    return found


def refuse_sparse(model: nn.Module, owner: dict[int, Any]) -> None:
    """A sparse embedding's gradient has no per-task Gramian here: one line names it."""
    for n, m in model.named_modules():
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse and id(m.weight) in owner:
            raise ValueError(
                f"hooks.{owner[id(m.weight)].name}: {n + '.weight'!r} has sparse gradients (sparse=True), "
                "which have no per-task Gramian; use sparse=False or leave it out of the rule"
            )


def batch_pays(slots: list, convolutions: set[int]) -> bool:
    """Whether one batched backward beats k ordinary passes: where the Linears on the rows'
    route (whose k output gradients it gives in one matmul per layer) hold at least as many
    of the rules' parameters as the tensors that need their own k gradients, and none of
    these is a convolution's (``convolutions``: ids). Those tensors (a convolution, a Linear
    on many rows, attention's projections) take vmap's copies and its per-op loops (pooling,
    attention, norms) in a batched backward, and a plain backward's kernels in k passes."""
    rows = {id(obj[0]): obj[0] for _, what, obj in slots if what == "layer"}
    on_rows = sum(getattr(layer.module, n).numel() for layer in rows.values() for n in layer.names)
    own = [obj for _, what, obj in slots if what == "param"]
    return bool(rows) and on_rows >= sum(p.numel() for p in own) and not any(id(p) in convolutions for p in own)


def task_grads(
    losses: list[Tensor], inputs: list, batched: bool, frontier: list[Tensor] = ()
) -> tuple[list[Tensor | None], bool]:
    """(``[k, *input]`` per input: the k losses' gradients, whether they came from a batched
    backward). Batched: one backward with the k rows of the identity (big matmuls), from
    the ``frontier`` tensors down where every path runs through them (``frontier``); else,
    or where the backward cannot run batched (a compiled backward's ``out=`` kernels), k
    plain passes, the same gradients."""
    if batched:
        through = reached(losses, list(frontier), inputs) if frontier else None
        try:
            with warnings.catch_warnings():  # an op without a batching rule loops over the k rows: right, slower
                warnings.filterwarnings("ignore", message=".*we have not yet implemented the batching rule")
                if through:
                    return task_grads_through(losses, through, inputs), True
                L = torch.stack(losses)
                eye = torch.eye(len(L), dtype=L.dtype, device=L.device)
                got = torch.autograd.grad(
                    L, inputs, grad_outputs=eye, is_grads_batched=True, retain_graph=True, allow_unused=True
                )
            return list(got), True
        except RuntimeError as e:
            if "Batching rule not implemented" not in str(e):
                raise
    return passes(losses, inputs), False


def passes(losses: list[Tensor], inputs: list) -> list[Tensor | None]:
    """``[k, *input]`` per input from k plain passes (None: no loss reaches it; zeros for the
    losses that do not where another does)."""
    rows = [  # a loss without a graph (a task without labels in the batch, as a constant 0): no gradient
        torch.autograd.grad(loss, inputs, retain_graph=True, allow_unused=True)
        if loss.requires_grad
        else (None,) * len(inputs)
        for loss in losses
    ]
    out: list[Tensor | None] = []
    for j in range(len(inputs)):
        found = [r[j] for r in rows]
        like = next((g for g in found if g is not None), None)
        out.append(None if like is None else torch.stack([torch.zeros_like(like) if g is None else g for g in found]))
    return out


def task_grads_through(losses: list[Tensor], frontier: list[Tensor], inputs: list) -> list[Tensor | None]:
    """``[k, *input]`` per input: each loss's gradient of the ``frontier`` tensors (the ones it
    reaches) in its own pass, then the k of them down to ``inputs`` in one batched pass."""
    cotangents = passes(losses, frontier)
    return list(
        torch.autograd.grad(
            [t for t, c in zip(frontier, cotangents) if c is not None],
            inputs,
            grad_outputs=[c for c in cotangents if c is not None],
            is_grads_batched=True,
            retain_graph=True,
            allow_unused=True,
        )
    )
