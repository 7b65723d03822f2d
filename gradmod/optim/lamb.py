"""LAMB's step in one piece: the Adam step of a group with ``trust_ratio: {of: update}`` and its ratio
``eta * min(||w||, clamp) / (||u|| + eps)`` on all of the group's tensors at once (``torch._foreach_*``
ops: the norms of every tensor in one call, no copy of the weights).

``gradmod.optim.Adam`` takes this path for the groups ``fits`` accepts; the others (and every other
optimizer) keep the step hooks of ``gradmod.optim.trust_ratio``, which rescale the step torch's
optimizer took. The two give the same step: the hooks' ``u`` is the step over ``lr``, here it is the
Adam direction itself, ``m / (sqrt(v) + eps)`` (bias-corrected where the group asks for it)."""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch
from torch import Tensor

from gradmod.optim.trust_ratio import KEY

UNFUSED = ("amsgrad", "capturable", "differentiable", "fused")  # torch's own paths for these


def fits(group: Mapping[str, Any]) -> bool:
    """Whether the group's LAMB step is taken here: a trust ratio of the update, on real tensors, with
    none of ``UNFUSED`` and ``foreach`` not turned off."""
    tr = group.get(KEY)
    if not tr or tr["of"] != "update" or group.get("foreach") is False:
        return False
    return not any(group.get(k) for k in UNFUSED) and not any(torch.is_complex(p) for p in group["params"])


@torch.no_grad()
def step(
    group: Mapping[str, Any],
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    steps: list[Tensor],
) -> None:
    """One LAMB step of ``params`` (those of ``group`` with a gradient, with Adam's state as torch's
    ``_init_group`` lists it), in place; ``steps`` count on."""
    if not params:
        return
    lr, wd = float(group["lr"]), float(group["weight_decay"])
    beta1, beta2 = group["betas"]
    torch._foreach_add_(steps, 1.0)
    if group["maximize"]:
        grads = torch._foreach_neg(grads)
    if wd and group["decoupled_weight_decay"]:
        torch._foreach_mul_(params, 1.0 - lr * wd)  # AdamW's decay, outside the ratio: w is the decayed weight
    elif wd:
        grads = torch._foreach_add(grads, params, alpha=wd)
    torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)
    denom = torch._foreach_sqrt(exp_avg_sqs)
    first = None  # the first moment's correction, 1 - beta1 ** step per tensor, where the group corrects
    if group.get("bias_correction", True):
        counts = [float(s) for s in steps]
        torch._foreach_div_(denom, [math.sqrt(1.0 - beta2**t) for t in counts])
        first = [1.0 - beta1**t for t in counts]
    torch._foreach_add_(denom, float(group["eps"]))
    # m / denom in place: a reciprocal and a product cost less than a division into a new tensor
    torch._foreach_reciprocal_(denom)
    torch._foreach_mul_(denom, exp_avgs)
    update = denom
    scale = ratios(params, update, group[KEY], first)
    torch._foreach_addcmul_(params, update, list((scale * -lr).unbind()))


def ratios(params: list[Tensor], update: list[Tensor], tr: Mapping[str, Any], first: list[float] | None) -> Tensor:
    """Each tensor's factor on its update ``m / denom``: the trust ratio, over the first moment's
    correction where there is one (``u = update / first``)."""
    w = torch.stack(torch._foreach_norm(params))
    if tr["clamp"] is not None:
        w = w.clamp(max=tr["clamp"])
    u = torch.stack(torch._foreach_norm(update))
    if first is not None:
        correction = torch.tensor(first, dtype=u.dtype, device=u.device)
        u = u / correction
    ratio = torch.where((w != 0) & (u != 0), tr["eta"] * w / (u + tr["eps"]), 1.0)
    if tr["mode"] == "clip":
        ratio = ratio.clamp(max=1.0)
    return ratio if first is None else ratio / correction
