"""The k task gradients of the gradient rules' entries: what the backward differentiates to
(``gather``), then one batched backward where it pays (``batch_pays``), else k passes.

A Linear the first forward's trace assigned (``saved``) is answered from its calls' output
gradients, a weight the losses also use apart from the layer's outputs (``reach.used_apart``)
and every other tensor of a rule from its own k gradients; a ``modules:`` rule's outputs from
theirs.

A batched backward of k losses carries k rows through every op, so each task's head also
runs for the k - 1 rows that are zero there: k heads cost k^2 head passes and their k
gradients of the representation are added in full. Where every path from the losses to the
rules' tensors runs through the outputs of one module (the frontier: the smallest module
holding all the rules' parameters, ``trunk`` for ``trunk.*``), each loss goes to those
outputs alone (its own head), and the k gradients found there go down together
(``task_grads_through``). Any other path (a tied weight used by a head, a loss on a
parameter, another output of the op that made the representation) and the step takes the
ordinary batched backward instead (``reach.reached``): always the same gradients.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from gradmod.hooks.per_loss.entries import Entry, LinearEntry, OutputEntry, ParamEntry
from gradmod.hooks.per_loss.loss_rules import LossRule
from gradmod.hooks.per_loss.reach import reached, used_apart
from gradmod.hooks.per_loss.saved import Saved


def gather(losses: list[Tensor], saved: Saved, rules: list[LossRule]) -> tuple[list, list[Entry]]:
    """What the backward differentiates to, and each gradient rule's entries, in the order of
    their inputs (a Linear answered from its rows before its rule's other tensors)."""
    inputs: list = []
    linear: list[Entry] = []
    own: list[Entry] = []
    rows = [layer for layer in saved.layers if layer.calls and layer.rows_pay(len(losses))]
    # A weight the losses also use apart from its layer's outputs: its own task gradients.
    by_rows = {id(layer) for layer in rows} - (used_apart(losses, rows, saved.model_outputs) if rows else set())
    for layer in saved.layers:
        live = sorted(n for n in layer.names if getattr(layer.module, n).requires_grad)  # frozen: no gradient
        if len(live) == len(layer.names) and id(layer) in by_rows:
            linear.append(LinearEntry(layer, len(inputs)))
            inputs += linear[-1].inputs
        elif layer.calls:  # its k task gradients from the backward itself
            for n in live:
                own.append(ParamEntry(layer.rule, getattr(layer.module, n), len(inputs)))
                inputs += own[-1].inputs
    for rule, p in saved.direct.values():
        if p.requires_grad:
            own.append(ParamEntry(rule, p, len(inputs)))
            inputs += own[-1].inputs
    for r in rules:
        for t in (t for m in r.modules for t in saved.outputs[id(m)]):
            own.append(OutputEntry(r, t, len(inputs)))
            inputs += own[-1].inputs
    return inputs, linear + own


def batch_pays(entries: list[Entry], convolutions: set[int]) -> bool:
    """Whether one batched backward beats k ordinary passes: where the Linears on the rows'
    route (whose k output gradients it gives in one matmul per layer) hold at least as many
    of the rules' parameters as the tensors that need their own k gradients, and none of
    these is a convolution's (``convolutions``: ids). Those tensors (a convolution, a Linear
    on many rows, attention's projections) take vmap's copies and its per-op loops (pooling,
    attention, norms) in a batched backward, and a plain backward's kernels in k passes."""
    on_rows = [p for e in entries for p in e.on_rows]
    own = [p for e in entries for p in e.own]
    return (
        bool(on_rows)
        and sum(p.numel() for p in on_rows) >= sum(p.numel() for p in own)
        and not any(id(p) in convolutions for p in own)
    )


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
