"""Each parameter group's learning rate by name, for the epoch line and the metrics: the
optimizer's class (``adamw``, ``muon``), the entry a group of the base optimizer came from
(``adam.groups.1``), its depth under ``layer_decay`` (``adamw.depth3``); a Muon group's adjusted
rate beside it (``muon.adjusted``: the rate its largest step takes, ``adjust_lr_fn`` applied to the
shape of each matrix it orthogonalises)."""

from __future__ import annotations

import math
from typing import Any

import torch

from gradmod.optim.combined import CombinedOptimizer


def group_rates(optimizer: torch.optim.Optimizer) -> dict[str, float]:
    """Group name -> its ``lr`` (the first group of a name; a ``no_decay`` twin has the same)."""
    held = optimizer.optimizers if isinstance(optimizer, CombinedOptimizer) else [optimizer]
    kinds = [type(o).__name__.lower() for o in held]
    out: dict[str, float] = {}
    for i, (o, kind) in enumerate(zip(held, kinds)):
        name = kind if kinds.count(kind) == 1 else f"{kind}{i}"
        for group in o.param_groups:
            label = name + (f".groups.{group['entry']}" if i == 0 and "entry" in group else "")
            label += f".depth{group['depth']}" if "depth" in group else ""
            out.setdefault(label, float(group["lr"]))
            adjusted = _adjusted(o, group)
            if adjusted is not None:
                out[f"{label}.adjusted"] = max(out.get(f"{label}.adjusted", 0.0), adjusted)
    return out


def _adjusted(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> float | None:
    """The largest rate a Muon group's matrices step at (torch's ``adjust_lr_fn``), None elsewhere."""
    muon = getattr(torch.optim, "Muon", None)
    if muon is None or not isinstance(optimizer, muon) or not group["params"]:
        return None
    return max(adjusted_lr(float(group["lr"]), group.get("adjust_lr_fn"), shape) for shape in _shapes(group))


def _shapes(group: dict[str, Any]) -> list[tuple[int, int]]:
    """The (out, in) shape of each matrix Muon orthogonalises: a kernel flattened, a transposed
    (Conv1D) weight turned, a split's row blocks."""
    k = group.get("split", 1)
    shapes = []
    for p in group["params"]:
        rows, cols = (p.shape[1], p.shape[0]) if group.get("transposed") else (p.shape[0], p.numel() // p.shape[0])
        shapes.append((rows // k, cols))
    return shapes


def adjusted_lr(lr: float, fn: str | None, shape: tuple[int, int]) -> float:
    """torch's Muon adjustment (``torch.optim.Muon``'s docs): original, match_rms_adamw, spectral_unclamped."""
    a, b = shape
    if fn in (None, "original"):
        return lr * math.sqrt(max(1.0, a / b))
    if fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(a, b))
    if fn == "spectral_unclamped":
        return lr * math.sqrt(a / b)
    return lr
