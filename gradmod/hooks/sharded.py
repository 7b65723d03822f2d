"""Gradients sharded by FSDP2 (``torch.distributed.fsdp.fully_shard``): DTensors.

After ``fully_shard`` each parameter (and its ``.grad``) is a ``DTensor`` of which a rank
holds one piece along dim 0. Most transforms run on it unchanged (DTensor reduces norms
over the shards itself); what reads numbers to the host needs the full tensor's values:
``plain`` for a value DTensor already reduced, ``sharded_rows`` for the ``log`` statistics
(each rank summarizes its piece, one gather combines them).
"""

from __future__ import annotations

import math
import sys

import torch
from torch import Tensor


def is_sharded(t: Tensor) -> bool:
    # Without torch.distributed.tensor imported (FSDP2 imports it) nothing is a DTensor;
    # importing it here would cost every user of the hooks a second at start.
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def plain(t: Tensor) -> Tensor:
    """A plain tensor with ``t``'s full value (no communication for a replicated DTensor)."""
    return t.full_tensor() if is_sharded(t) else t


def sharded_rows(tensors: list[Tensor], paired: int) -> list[Tensor]:
    """``GradStats`` rows (norm, min, max, mean, frac_negative, nonfinite, frac_clipped)
    of the full tensors behind DTensor gradients, the same on every rank. Each rank
    reduces its pieces to sums, extremes and counts; one ``all_gather`` over the mesh
    combines them. ``paired``: the first ``paired`` tensors are ``pre`` observations, the next ``paired`` their ``post`` partners."""
    pieces = [t.to_local().detach().float().reshape(-1) for t in tensors]
    inf = torch.full((1,), math.inf, device=pieces[0].device)  # the extremes of an empty piece
    local = []
    for i, g in enumerate(pieces):
        changed = g.new_zeros(())
        if paired <= i < 2 * paired:
            before = pieces[i - paired]
            changed = ((g != before) & ~(g.isnan() & before.isnan())).sum().float()
        local.append(
            torch.stack(
                [
                    (g * g).sum(),
                    torch.cat([g, inf]).min(),
                    torch.cat([g, -inf]).max(),
                    g.sum(),
                    (g < 0).sum().float(),
                    (g * 0).isnan().sum().float(),
                    changed,
                ]
            )
        )
    mine = torch.stack(local)
    group = tensors[0].device_mesh.get_group()
    every = [torch.empty_like(mine) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(every, mine, group=group)
    parts = torch.stack(every)  # (ranks, tensors, 7)
    sums = parts.sum(0)
    count = torch.tensor([float(t.numel()) for t in tensors], device=mine.device)
    rows = torch.stack(
        [
            sums[:, 0].sqrt(),
            parts[:, :, 1].amin(0),
            parts[:, :, 2].amax(0),
            sums[:, 3] / count,
            sums[:, 4] / count,
            sums[:, 5],
            sums[:, 6] / count,
        ],
        1,
    )
    return list(rows.unbind(0))


def refuse_sharded(stage: str, hint: str, targets, params: dict[str, Tensor]) -> None:
    """One line for parameter rules at ``stage`` that cannot run on sharded parameters (every
    stage but fused): a tensor hook never fires on an FSDP2 parameter (and the DDP meaning,
    each rank's whole local gradient, would need FSDP2's private unsharded parameters);
    per-example or per-task gradients would need the gathered weights in every layer's
    backward. ``hint``: what to do instead."""
    for t in targets:
        if t.kind == "param" and t.stage == stage and is_sharded(params[t.name]):
            raise ValueError(
                f"hooks.{t.rule}: stage {t.stage!r} on {t.name!r}, a parameter sharded by FSDP2 (fully_shard); {hint}"
            )


def watch(model: torch.nn.Module, params: dict[str, Tensor]):
    """A forward pre-hook that checks, once, that ``params`` are still ``model``'s:
    ``fully_shard`` after ``attach`` replaces them, and the rules would silently do nothing.
    Then the first backward through the model raises one line (the forward itself when
    its output has no gradient to hook). Returns the handle."""

    def check(module, inputs) -> None:
        if not torch.is_grad_enabled():
            return
        # torch.func.functional_call swaps plain tensors in for one call: only sharded
        # replacements (fully_shard's DTensors) mean the rules were left behind
        stale = [n for n, p in params.items() if _get(module, n) is not p and is_sharded(_get(module, n))]
        if not stale and any(_get(module, n) is not p for n, p in params.items()):
            return  # look again at the next forward, with the model's own parameters
        handle.remove()
        if stale:
            message = (
                f"attach: the parameters the rules select were replaced after attach ({stale[0]!r} among "
                "them), as fully_shard does; call gradmod.attach(model, rules) after fully_shard(model)"
            )
            once = module.register_forward_hook(lambda m, i, out: _refuse_backward(out, message, once))

    handle = model.register_forward_pre_hook(check)
    return handle


def _refuse_backward(output, message: str, handle) -> None:
    handle.remove()
    out = next(
        (
            t
            for t in (output if isinstance(output, (tuple, list)) else (output,))
            if isinstance(t, Tensor) and t.requires_grad
        ),
        None,
    )
    if out is None:
        raise ValueError(message)

    def refuse(grad):
        raise ValueError(message)

    out.register_hook(refuse)


def _get(module: torch.nn.Module, name: str):
    try:
        return module.get_parameter(name)
    except AttributeError:
        return None
