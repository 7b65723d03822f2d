"""The one backward after the task gradients: every parameter outside the gradient rules
gets the gradient of the sum of the losses (a loss weighting's parameters: of its weighted
sum; a weighting that gives every task one weight scales the plain sum's gradient on its
parameters instead, in the same backward; where each other parameter is reached by one
loss alone, the weighted sum's backward serves all, those parameters divided back by their
loss's weight), the module rules' aggregates handed on through their outputs' hooks."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from gradmod.hooks.per_loss.owners import SHARED, loss_owners


def rest_backward(stage: Any, names: list[str], listed: list[Tensor], replace: dict, grad_rules: list) -> None:
    """The parameters outside the gradient rules: the gradient of the sum of the losses
    (of a loss weighting's weighted sum for its rule's parameters), the module rules'
    aggregates handed on through their outputs."""
    L = torch.stack(listed)
    covered = {id(p) for r in grad_rules for p in r.params}
    weighted = [r for r in stage.rules if r.method.kind == "losses"]
    groups: list[tuple[tuple, list[nn.Parameter]]] = []  # (a root: (tensor, weights or None), its parameters)
    scaled: list[tuple[nn.Parameter, float]] = []
    host, finite = _host(stage, L, weighted)
    for r in weighted:
        weights = _weights(r, names, host, finite, stage.generator)
        weighted_root = (L, weights)  # sum_i w_i L_i: the backward of L with w as its gradient, no dot
        params = [p for p in r.params if p.requires_grad]  # (frozen since attach: no gradient)
        if params and all(v == weights[0] for v in weights) and math.isfinite(weights[0]):
            # One weight for every task: the gradient of the plain sum, times it, in the
            # one backward of the sum (the smaller side of the model scaled, below).
            if weights[0] != 1.0:
                scaled += [(p, weights[0]) for p in params]
        elif params:
            groups.append((weighted_root, params))
            covered.update(id(p) for p in params)
        outs = [t for m in r.modules for t in stage.outputs[id(m)]]
        if outs:  # a modules rule: the weighted sum's gradient enters the module through its outputs
            root, start = _tensors(weighted_root)
            got = torch.autograd.grad(root, outs, start, retain_graph=True, materialize_grads=True)
            replace.update({id(t): (t, g) for t, g in zip(outs, got)})
    rest = [p for p in stage.trainable if id(p) not in covered]
    rest_loss = None  # the plain sum's (or what a method asks), unless the weighted sum serves
    if scaled and len(weighted) == 1 and not grad_rules and len(rest) == len(stage.trainable):
        # One scale on most of the model: the weighted sum's backward, the few others scaled back.
        mine = {id(p) for p, _ in scaled}
        others = [p for p in rest if id(p) not in mine]
        if sum(p.numel() for p in others) < sum(p.numel() for p, _ in scaled) and not any(map(_hooked, others)):
            rest_loss, scaled = weighted_root, [(p, 1.0 / scaled[0][1]) for p in others]
    if rest:
        groups.append((_rest_loss(L, grad_rules) if rest_loss is None else rest_loss, rest))
    handles = [t.register_hook(lambda _g, agg=agg: agg) for t, agg in replace.values()]
    if len(weighted) == 1 and len(groups) == 2 and groups[0][0] is weighted_root and not grad_rules and not replace:
        # One weighting on part of the model: the weighted sum's one backward, each other
        # parameter (one loss's alone: a head) divided back by its loss's weight.
        back = _divided_back(listed, groups[1][1], weights)
        if back is not None:
            groups = [(weighted_root, groups[0][1] + groups[1][1])]
            scaled += back
    # Scaled after the backward in one call where .grad starts empty, else as it arrives
    # (.grad holds earlier micro-batches, or a post-accumulate hook reads it: an optimizer
    # stepped in backward); a hook per parameter costs more than the multiply.
    late = [p.grad is None and not p._post_accumulate_grad_hooks for p, _ in scaled]
    after = [s for s, ok in zip(scaled, late) if ok]
    handles += [p.register_hook(lambda g, c=c: g * c) for (p, c), ok in zip(scaled, late) if not ok]
    try:
        if len(groups) == 1 and len(groups[0][1]) == len(stage.trainable):
            torch.autograd.backward(*_tensors(groups[0][0]))  # everything from one root: no restriction needed
        else:
            for i, (root, params) in enumerate(groups):
                torch.autograd.backward(*_tensors(root), inputs=params, retain_graph=i < len(groups) - 1)
    finally:
        for h in handles:
            h.remove()
    after = [(p.grad, c) for p, c in after if p.grad is not None]
    if after:
        torch._foreach_mul_(*map(list, zip(*after)))


def loss_weights(stage: Any, r: Any, names: list[str], L: Tensor) -> list[float]:
    """A loss weighting's k weights for this step's losses ``L`` (stacked), recorded."""
    return _weights(r, names, *_host(stage, L, [r]), stage.generator)


def _host(stage: Any, L: Tensor, weighted: list) -> tuple[Tensor, bool]:
    """The losses as the weightings read them, and whether all are finite. On the host, and
    the global batch's under ``reduce``, where one reads the values; else unread (``sum``,
    ``mean``, ``random``)."""
    if not any(r.method.reads_losses for r in weighted):
        return L.detach(), True
    values = L.detach()
    if stage.reduce is not None:
        values = values.clone()
        stage.reduce([values])
    host = stage.unscaled(values.cpu(), 1)
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


def _rest_loss(L: Tensor, grad_rules: list) -> tuple:
    """The plain sum, or the weighted one a method asks for the parameters outside it
    (``nash_mtl`` with ``heads: weighted``), as a root."""
    asked = [w for r in grad_rules if (w := getattr(r.method, "rest_weights", lambda: None)()) is not None]
    if not asked:
        return L.sum(), None
    return L, asked[0].tolist()


def _weights(r: Any, names: list[str], host: Tensor, finite: bool, gen: torch.Generator) -> list[float]:
    """A loss weighting's k weights as host floats (it may give a tensor or a sequence),
    recorded. A non-finite loss gives nan weights without asking the method (its state
    stays as it was)."""
    if not finite:
        return [math.nan] * len(names)
    got = r.method.loss_weights(host, gen)
    weights = got.tolist() if isinstance(got, Tensor) else [float(v) for v in got]
    if len(weights) != len(names):
        raise ValueError(
            f"hooks.{r.name}: per_loss method {r.method_name!r} gave {len(weights)} loss weights for "
            f"{len(names)} losses; give one per loss"
        )
    r.record.add(names, None, weights)
    return weights


def _tensors(root: tuple) -> tuple[Tensor, Tensor | None]:
    """A root's tensor and the gradient its backward starts from (None: a scalar's 1)."""
    t, weights = root
    return t, None if weights is None else torch.tensor(weights, dtype=t.dtype, device=t.device)
