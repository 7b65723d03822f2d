"""The one backward of the sum of the losses, after the task gradients or in their place.

After them (``rest_backward``): every parameter outside the gradient rules gets the gradient
of the sum of the losses (a loss weighting's parameters: of its weighted sum; a weighting
that gives every task one weight scales the plain sum's gradient on its parameters instead,
in the same backward; where each other parameter is reached by one loss alone, the weighted
sum's backward serves all, those parameters divided back by their loss's weight), the module
rules' aggregates handed on through their outputs' hooks.

In their place (``one_pass``): a lone ``modules:`` rule whose one output each loss reaches
through a head of its own (``reach.head_edges``): each head's gradient of the output is
caught as the head hands it on in the one backward of the sum, and the rule's aggregate (a
loss weighting's: ``sum_i w_i g_i``) replaces their sum there. No pass through the heads
per task or for the weighted sum; the same gradients.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.autograd.graph import Node

from gradmod.hooks.per_loss.backward import Backward
from gradmod.hooks.per_loss.combine import combine
from gradmod.hooks.per_loss.entries import OutputEntry, Replace
from gradmod.hooks.per_loss.loss_rules import LossRule
from gradmod.hooks.per_loss.methods.bases import LossWeighting
from gradmod.hooks.per_loss.reach import SHARED, loss_owners

Root = tuple[Tensor, list[float] | None]  # a tensor and the weights its backward starts from (None: a scalar's 1)


@dataclass
class _Plan:
    """The backward's roots, each with the parameters it is for (``groups``), the parameters
    whose gradient is scaled after (``scaled``), and the last loss weighting's root."""

    L: Tensor
    groups: list[tuple[Root, list[nn.Parameter]]] = field(default_factory=list)
    scaled: list[tuple[nn.Parameter, float]] = field(default_factory=list)
    weighted: Root | None = None


def rest_backward(call: Backward, weightings: list[LossRule], grad_rules: list[LossRule], replace: Replace) -> None:
    """The parameters outside the gradient rules (``grad_rules``): the gradient of the sum of
    the losses (of a loss weighting's weighted sum for its rule's parameters), the module
    rules' aggregates (``replace``) handed on through their outputs."""
    plan = _Plan(torch.stack(call.losses))
    covered = {id(p) for r in grad_rules for p in r.params}
    host, finite = _host(call, plan.L, weightings)
    for r in weightings:
        _weigh(call, r, plan, _weights(call, r, host, finite), covered, replace)
    rest = [p for p in call.trainable if id(p) not in covered]
    rest_root = _one_scale(plan, rest, call.trainable) if len(weightings) == 1 and not grad_rules else None
    if rest:
        plan.groups.append((_rest_loss(plan.L, grad_rules) if rest_root is None else rest_root, rest))
    handles = [t.register_hook(lambda _g, agg=agg: agg) for t, agg in replace.values()]
    if len(weightings) == 1 and not grad_rules and not replace:
        _one_root(plan, call.losses)
    _run(plan, call.trainable, handles)


def _weigh(call: Backward, r: LossRule, plan: _Plan, weights: list[float], covered: set[int], replace: Replace) -> None:
    """A loss weighting's root ``sum_i w_i L_i`` (the backward of L with w as its gradient, no
    dot) for its parameters, and its module outputs' gradients of it."""
    plan.weighted = (plan.L, weights)
    params = [p for p in r.params if p.requires_grad]  # (frozen since attach: no gradient)
    if params and all(v == weights[0] for v in weights) and math.isfinite(weights[0]):
        # One weight for every task: the gradient of the plain sum, times it, in the
        # one backward of the sum (the smaller side of the model scaled, below).
        if weights[0] != 1.0:
            plan.scaled += [(p, weights[0]) for p in params]
    elif params:
        plan.groups.append((plan.weighted, params))
        covered.update(id(p) for p in params)
    outs = [t for m in r.modules for t in call.outputs[id(m)]]
    if outs:  # a modules rule: the weighted sum's gradient enters the module through its outputs
        root, start = _tensors(plan.weighted)
        got = torch.autograd.grad(root, outs, start, retain_graph=True, materialize_grads=True)
        replace.update({id(t): (t, g) for t, g in zip(outs, got)})


def _one_scale(plan: _Plan, rest: list[nn.Parameter], trainable: list[nn.Parameter]) -> Root | None:
    """One scale on most of the model: the weighted sum's backward for all, the few others
    scaled back; None (the plain sum's) where the scaled side is the smaller."""
    if not plan.scaled or len(rest) != len(trainable):
        return None
    mine = {id(p) for p, _ in plan.scaled}
    others = [p for p in rest if id(p) not in mine]
    if sum(p.numel() for p in others) < sum(p.numel() for p, _ in plan.scaled) and not any(map(_hooked, others)):
        plan.scaled = [(p, 1.0 / plan.scaled[0][1]) for p in others]
        return plan.weighted
    return None


def _one_root(plan: _Plan, losses: list[Tensor]) -> None:
    """One weighting on part of the model: the weighted sum's one backward, each other
    parameter (one loss's alone: a head) divided back by its loss's weight."""
    if len(plan.groups) != 2 or plan.weighted is None or plan.groups[0][0] is not plan.weighted:
        return
    back = _divided_back(losses, plan.groups[1][1], plan.weighted[1] or [])
    if back is not None:
        plan.groups = [(plan.weighted, plan.groups[0][1] + plan.groups[1][1])]
        plan.scaled += back


def _run(plan: _Plan, trainable: list[nn.Parameter], handles: list) -> None:
    """The backward from each root to its parameters, the scaled ones scaled. Scaled after
    the backward in one call where .grad starts empty, else as it arrives (.grad holds
    earlier micro-batches, or a post-accumulate hook reads it: an optimizer stepped in
    backward); a hook per parameter costs more than the multiply."""
    late = [p.grad is None and not p._post_accumulate_grad_hooks for p, _ in plan.scaled]
    after = [s for s, ok in zip(plan.scaled, late) if ok]
    handles += [p.register_hook(lambda g, c=c: g * c) for (p, c), ok in zip(plan.scaled, late) if not ok]
    groups = plan.groups
    try:
        if len(groups) == 1 and len(groups[0][1]) == len(trainable):
            torch.autograd.backward(*_tensors(groups[0][0]))  # everything from one root: no restriction needed
        else:
            for i, (root, params) in enumerate(groups):
                torch.autograd.backward(*_tensors(root), inputs=params, retain_graph=i < len(groups) - 1)
    finally:
        for h in handles:
            h.remove()
    done = [(p.grad, c) for p, c in after if p.grad is not None]
    if done:
        torch._foreach_mul_(*map(list, zip(*done)))


def one_pass(call: Backward, rule: LossRule, out: Tensor, edges: list[list[tuple[Node, list[int]]]]) -> None:
    """The backward of the sum, ``rule``'s task gradients of its one output ``out`` caught from
    the heads (``edges``: per loss, the nodes that take ``out`` in and where) and replaced by
    its aggregate there."""
    weighting = isinstance(rule.method, LossWeighting)
    L = torch.stack(call.losses) if weighting else None  # a loss weighting's: weights, backward
    weights = None if L is None else loss_weights(call, rule, L)
    caught: list[Tensor | None] = [None] * len(call.losses)

    def catch(i: int, at: list[int]):
        def hook(grad_inputs, grad_outputs):
            for j in at:
                if grad_inputs[j] is not None:
                    caught[i] = grad_inputs[j] if caught[i] is None else caught[i] + grad_inputs[j]

        return hook

    def aggregate(total: Tensor) -> Tensor | None:
        if weights is not None:
            return _weighted_sum(weights, caught)
        entry = OutputEntry(rule, out, 0)
        entry.take([torch.stack([torch.zeros_like(total) if g is None else g for g in caught])])
        replace = combine(call, rule, [entry])
        return replace[id(out)][1] if id(out) in replace else None

    handles = [node.register_hook(catch(i, at)) for i, mine in enumerate(edges) for node, at in mine]
    handles.append(out.register_hook(aggregate))
    try:
        if L is None:
            rest_backward(call, [], [rule], {})
        else:  # every parameter but through the output: the plain sum's gradient
            torch.autograd.backward(L.sum())
    finally:
        for h in handles:
            h.remove()


def _weighted_sum(weights: list[float], caught: list[Tensor | None]) -> Tensor | None:
    acc = None
    for w, g in zip(weights, caught):
        if g is not None:
            acc = g * w if acc is None else acc.add_(g, alpha=w)
    return acc


def loss_weights(call: Backward, r: LossRule, L: Tensor) -> list[float]:
    """A loss weighting's k weights for this step's losses ``L`` (stacked), recorded."""
    return _weights(call, r, *_host(call, L, [r]))


def _host(call: Backward, L: Tensor, weighted: list[LossRule]) -> tuple[Tensor, bool]:
    """The losses as the weightings read them, and whether all are finite. On the host, and
    the global batch's under ``reduce``, where one reads the values; else unread (``sum``,
    ``mean``, ``random``)."""
    if not any(r.method.reads_losses for r in weighted):
        return L.detach(), True
    values = L.detach()
    if call.reduce is not None:
        values = values.clone()
        call.reduce([values])
    host = call.unscaled(values.cpu(), 1)
    return host, all(map(math.isfinite, host.tolist()))  # Python floats: a torch op each costs more


def _divided_back(losses: list[Tensor], others: list[nn.Parameter], weights: list[float]) -> list | None:
    """``(p, 1 / w_i)`` for each of ``others`` the losses reach, where one loss alone (``i``)
    reaches each, its weight is neither zero nor far from one (``w_i g / w_i`` is then
    ``g`` to the dtype's rounding) and no hook reads its gradient in the backward; else None."""
    owners = loss_owners(losses)
    if owners is None:
        return None
    out = []
    for p in others:
        i = owners.get(id(p))
        if i is None:
            continue  # no loss reaches it: no gradient either way
        if i == SHARED or _hooked(p) or not 1e-6 <= abs(weights[i]) <= 1e6:
            return None
        out.append((p, 1.0 / weights[i]))
    return out


def _hooked(p: nn.Parameter) -> bool:
    """A tensor hook on ``p`` (a hook-stage rule): it would see ``w_i`` times the gradient it
    must see, before the division back."""
    return bool(p._backward_hooks)


def _rest_loss(L: Tensor, grad_rules: list[LossRule]) -> Root:
    """The plain sum, or the weighted one a method asks for the parameters outside it
    (``nash_mtl`` with ``heads: weighted``), as a root."""
    asked = [w for r in grad_rules if (w := r.method.rest_weights()) is not None]
    if not asked:
        return L.sum(), None
    return L, asked[0].tolist()


def _weights(call: Backward, r: LossRule, host: Tensor, finite: bool) -> list[float]:
    """A loss weighting's k weights as host floats (it may give a tensor or a sequence),
    recorded. A non-finite loss gives nan weights without asking the method (its state
    stays as it was)."""
    names = call.names
    if not finite:
        return [math.nan] * len(names)
    assert isinstance(r.method, LossWeighting)
    got = r.method.loss_weights(host, call.generator)
    weights = got.tolist() if isinstance(got, Tensor) else [float(v) for v in got]
    if len(weights) != len(names):
        raise ValueError(
            f"hooks.{r.name}: per_loss method {r.method_name!r} gave {len(weights)} loss weights for "
            f"{len(names)} losses; give one per loss"
        )
    r.record.add(names, None, weights)
    return weights


def _tensors(root: Root) -> tuple[Tensor, Tensor | None]:
    """A root's tensor and the gradient its backward starts from (None: a scalar's 1)."""
    t, weights = root
    return t, None if weights is None else torch.tensor(weights, dtype=t.dtype, device=t.device)
