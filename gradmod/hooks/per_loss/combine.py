"""Each gradient rule's update from its entries' task gradients (the stage's "apply").

A Gramian weighting's: the Gramian ``G_ij = <g_i, g_j>`` summed over the rule's entries (each
entry's part from its own pieces: a Linear's from its rows; in float64, ``entries.gram``), the
method's weights from it on the host (told the dtype of the task gradients, whose rounding
the Gramian carries: ``rounding.formed_in``), then each entry's share of ``sum_i w_i g_i``.
An aggregator's, and under ``reduce`` a ``params`` rule's: the task gradients themselves as
one ``[k, D]`` matrix (averaged over the ranks, then the global batch's Gramian), the update
cut back into pieces; a non-finite one gives a nan update without asking the aggregator, as a
Gramian method's.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from gradmod.hooks.per_loss.backward import Backward
from gradmod.hooks.per_loss.entries import Entry, OutputEntry, Replace, coarsest, gram
from gradmod.hooks.per_loss.loss_rules import LossRule
from gradmod.hooks.per_loss.methods.bases import Aggregator, GramianWeighting, MatrixWeighting
from gradmod.hooks.per_loss.methods.rounding import formed_in


def combine(call: Backward, rule: LossRule, entries: list[Entry]) -> Replace:
    """Add the rule's update to its parameters' ``.grad``; what a ``modules:`` rule's outputs
    hand on instead is returned (id(output) -> (it, its aggregated gradient))."""
    replace: Replace = {}
    if entries and (isinstance(rule.method, Aggregator) or (call.reduce is not None and rule.params)):
        _from_jacobian(call, rule, entries, replace)
    elif entries:
        G = _gramian(call, rule, entries)
        w = weights(call, rule, call.unscaled(G.detach().cpu(), 2), entries)
        wd = w.to(device=G.device)
        for e in entries:
            e.update(wd, replace)
    return replace


def _gramian(call: Backward, rule: LossRule, entries: list[Entry]) -> Tensor:
    """The rule's task Gramian, of the global batch under ``reduce`` (a ``modules`` rule: each
    rank's rows of the global Jacobian are 1/R of its own)."""
    if rule.rows == "batch":  # LibMTL's rep_grad: each task's output gradient summed over the batch (dim 0)
        S = torch.cat([e.batch_rows() for e in entries if isinstance(e, OutputEntry)], 1)  # a modules rule's
        if call.reduce is not None:  # the global batch's sums: the mean of the ranks' (each loss a mean)
            S = S.detach().clone()
            call.reduce([S])
        return gram(S)
    G = sum(e.gram() for e in entries)
    assert isinstance(G, Tensor)
    if call.reduce is not None:
        G = G.detach().clone()
        call.reduce([G])
        G = G / reduce_size()
    return G


def weights(call: Backward, rule: LossRule, G: Tensor, entries: list[Entry]) -> Tensor:
    """The method's weights, recorded, the Gramian's rounding that of the entries' task
    gradients' coarsest dtype, or autocast's (``rounding.precision``); a non-finite Gramian
    (a nan or inf in a task's loss or gradient) gives nan weights without asking the method,
    whose solver would fail and whose state would keep the nan: the update is nan, and the
    trainer's non-finite policy (``skip``, ``raise``) and its divergence check act on it as
    on any other step."""
    if not torch.isfinite(G).all():
        return torch.full((len(G),), math.nan, dtype=G.dtype)
    assert isinstance(rule.method, GramianWeighting)
    with formed_in(coarsest(*(e.dtype for e in entries), call.autocast or torch.float64)):
        w = rule.method.weights(G, call.generator)
    rule.record.add(call.names, G, w)
    return w


def _from_jacobian(call: Backward, rule: LossRule, entries: list[Entry], replace: Replace) -> None:
    """The task gradients themselves, one [k, D] matrix: for an aggregator, and under
    ``reduce`` (averaged across ranks, then the Gramian of the global batch)."""
    order = {id(p): i for i, p in enumerate(call.trainable)}  # the Jacobian's columns: parameters in model order
    pieces = [(e, t, g) for e in entries for t, g in e.pieces()]
    pieces.sort(key=lambda x: order.get(id(x[1]), len(order)))  # (a module's outputs last)
    J = torch.cat([g for _, _, g in pieces], 1)
    if call.reduce is not None and rule.params:
        J = J.detach().clone()
        call.reduce([J])
    Gh = call.unscaled(gram(J.detach()).cpu(), 2)
    if isinstance(rule.method, Aggregator) and not torch.isfinite(Gh).all():
        out = torch.full_like(J[0], math.nan)  # as ``weights``: the aggregator (and its state) left alone
    elif isinstance(rule.method, MatrixWeighting):
        w = rule.method.matrix_weights(call.unscaled(J.detach(), 1))
        rule.record.add(call.names, Gh, w.detach().to("cpu", torch.float64))
        out = w.to(J.dtype) @ J
    elif isinstance(rule.method, Aggregator):
        out = _aggregate(call, rule, J, [(t, g) for _, t, g in pieces])
        rule.record.add(call.names, Gh, None)
    else:
        out = torch.tensordot(weights(call, rule, Gh, entries).to(J.device, J.dtype), J, 1)
    at = 0
    for e, t, g in pieces:
        e.put(t, out[at : at + g.shape[1]].view_as(t), replace)
        at += g.shape[1]


def _aggregate(call: Backward, rule: LossRule, J: Tensor, pieces: list[tuple[Tensor, Tensor]]) -> Tensor:
    """An aggregator's update: of ``J``, or with ``rows: batch`` (graddrop's form on a
    representation) per feature over the batch, one draw per feature."""
    method = rule.method
    assert isinstance(method, Aggregator)
    if rule.rows != "batch":
        U = torch.rand(J.shape[1], generator=call.generator, dtype=J.dtype).to(J.device)
        return method.aggregate(J, U)
    out = []
    for t, g in pieces:  # a module output's [k, numel] task gradients, the batch its first dimension
        D = g.view(len(g), t.shape[0] if t.dim() else 1, -1)
        U = torch.rand(D.shape[2], generator=call.generator, dtype=D.dtype).to(D.device)
        out.append(method.aggregate_batch(D, t.detach().sign().reshape(D.shape[1:]), U).flatten())  # type: ignore[attr-defined]
    return torch.cat(out)


def reduce_size() -> int:
    """The number of ranks ``reduce`` averages over."""
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
