"""``trust_ratio``: a layer-wise rate ``eta * ||w|| / ||g||`` for the groups an ``optimizer.groups``
entry selects by glob (LARS, LARC, LAMB).

``of: grad`` (LARC's semantics, NVIDIA apex's ``LARC`` wrapper): before the optimizer steps, each
selected tensor's gradient becomes ``ratio * (g + weight_decay * w)`` with ``ratio = eta * ||w|| /
(||g|| + weight_decay * ||w|| + eps)`` (1 where a norm is 0), in ``scale`` mode (LARS) or, in ``clip``
mode (LARC), ``min(ratio / lr, 1)``; ``weight_decay`` is LARS's, inside the ratio. SGD with momentum
then steps as LARS (``optimizer=lars``).

``of: update`` (LAMB): the step the optimizer takes is rescaled to ``ratio = eta * min(||w||, clamp) /
(||u|| + eps)`` times it, ``u`` the step over ``lr``; a decoupled weight decay (AdamW's) stays outside
it, and ``w`` is the decayed weight, as pytorch-optimizer's ``Lamb``. Adam without bias correction
then steps as LAMB (``optimizer=lamb``). ``clip``: the ratio at most 1 (timm's ``trust_clip``).

Both act through the optimizer's step hooks (``register_step_pre_hook``), so any optimizer, a
scheduler and ``GradScaler`` (which unscales before the step) see one optimizer; but
``gradmod.optim.Adam`` takes ``of: update`` inside its own step (``gradmod.optim.lamb``: no copy of
the weights, fewer passes), where the group fits, and the hooks leave those groups alone."""

from __future__ import annotations

import math
import numbers
from typing import Any, Mapping

import torch
from torch import Tensor

KEY = "trust_ratio"
DEFAULTS: dict[str, Any] = {"eta": 1.0, "mode": "scale", "of": "grad", "weight_decay": 0.0, "eps": 0.0, "clamp": None}
CHOICES = {"mode": ("scale", "clip"), "of": ("grad", "update")}


def settings(where: str, value: Any) -> dict[str, Any]:
    """An entry's ``trust_ratio`` (``true`` or a mapping of ``DEFAULTS``' keys) checked, with every key."""
    if value is True:
        value = {}
    if not isinstance(value, Mapping):
        raise ValueError(f"{where}: {value!r} must be true or a mapping with {', '.join(DEFAULTS)}")
    unknown = sorted(set(value) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"{where}.{unknown[0]}: trust_ratio takes no {unknown[0]!r}; it takes {', '.join(DEFAULTS)}")
    out = {**DEFAULTS, **value}
    for key, allowed in CHOICES.items():
        if out[key] not in allowed:
            raise ValueError(f"{where}.{key}: {out[key]!r}; allowed: {', '.join(allowed)}")
    for key in ("eta", "weight_decay", "eps", "clamp"):
        v = out[key]
        if v is None and key == "clamp":
            continue
        if (
            isinstance(v, bool)
            or not isinstance(v, numbers.Real)
            or not math.isfinite(v)
            or v < 0
            or (key == "eta" and v == 0)
        ):
            raise ValueError(f"{where}.{key}: {v!r} must be a finite number {'> 0' if key == 'eta' else '>= 0'}")
        out[key] = float(v)
    if out["of"] == "update" and out["weight_decay"]:
        raise ValueError(
            f"{where}.weight_decay: LARS's decay inside the ratio acts with of: grad; with of: update give the "
            "optimizer's own weight_decay (decoupled, as LAMB's)"
        )
    return out


def attach(optimizer: torch.optim.Optimizer) -> None:
    """The hooks that apply the groups' ``trust_ratio`` around ``optimizer.step()`` (none if no group has one)."""
    if not any(g.get(KEY) for g in optimizer.param_groups):
        return
    # of: update: each weight before the step, in a buffer kept from step to step (not in the state:
    # a checkpoint need not hold it), and its norm after the step's decoupled decay
    before_step: dict[int, Tensor] = {}
    held: dict[int, tuple[list[Tensor], list[Tensor], Tensor, float]] = {}
    inside = getattr(optimizer, "takes_trust_ratio", None)  # gradmod.optim.Adam's LAMB groups

    def before(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        held.clear()
        for i, group in enumerate(opt.param_groups):
            tr = group.get(KEY)
            if tr and inside is not None and inside(group):
                continue
            params = [p for p in group["params"] if p.grad is not None] if tr else []
            if not params:
                continue
            if tr["of"] == "grad":
                scale_grads(params, [p.grad for p in params], float(group["lr"]), tr)  # type: ignore[misc]
                continue
            decay = group.get("weight_decay", 0.0) if group.get("decoupled_weight_decay") else 0.0
            kept = 1.0 - float(group["lr"]) * decay  # the weight after the step's own decay: kept * w
            with torch.no_grad():
                bufs = [before_step.setdefault(id(p), torch.empty_like(p)) for p in params]
                torch._foreach_copy_(bufs, params)
                norms = torch.stack(torch._foreach_norm(params)) * kept
            held[i] = (params, bufs, norms, kept)

    def after(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for i, (params, bufs, norms, kept) in held.items():
            group = opt.param_groups[i]
            with torch.no_grad():
                scale_update(params, bufs, norms, kept, float(group["lr"]), group[KEY])
        held.clear()

    optimizer.register_step_pre_hook(before)
    optimizer.register_step_post_hook(after)


@torch.no_grad()
def scale_grads(params: list[Tensor], grads: list[Tensor], lr: float, tr: Mapping[str, Any]) -> None:
    """LARS/LARC on the gradients, in place (as apex's LARC and pytorch-optimizer's LARS write them)."""
    wd = tr["weight_decay"]
    w = torch.stack(torch._foreach_norm(params))
    g = torch.stack(torch._foreach_norm(grads))
    denominator = g + wd * w
    ratio = torch.where(w > 0.0, torch.where(denominator > 0.0, tr["eta"] * w / (denominator + tr["eps"]), 1.0), 1.0)
    if tr["mode"] == "clip":
        ratio = torch.clamp(ratio / lr, max=1.0)
    if wd:
        torch._foreach_add_(grads, params, alpha=wd)
    torch._foreach_mul_(grads, ratio.unbind())


def scale_update(
    params: list[Tensor], bufs: list[Tensor], norms: Tensor, kept: float, lr: float, tr: Mapping[str, Any]
) -> None:
    """LAMB's ratio on the step just taken: ``w + ratio * (p - w)``, ``w = kept * bufs`` the decayed
    weight (``norms``: its norms); in place, ``bufs`` as scratch."""
    torch._foreach_add_(bufs, params, alpha=-1.0 / kept)  # (w - p) / kept = lr * u / kept, in one pass
    w = norms if tr["clamp"] is None else norms.clamp(max=tr["clamp"])
    u = torch.stack(torch._foreach_norm(bufs)) * (kept / lr) if lr else torch.zeros_like(w)
    ratio = torch.where((w != 0) & (u != 0), tr["eta"] * w / (u + tr["eps"]), 1.0)
    if tr["mode"] == "clip":
        ratio = ratio.clamp(max=1.0)
    # p + (1 - ratio)(w - p) = w + ratio (p - w), in one pass (a 0-dim factor per tensor)
    torch._foreach_addcmul_(params, bufs, list(((1.0 - ratio) * kept).unbind()))
