"""What a resumed run may change: the checkpoint's config against the new one.

Must match (else one error naming each difference; ``trainer.resume_accept=[key, ...]``
accepts the named keys, or everything below a named prefix such as ``data``): what decides
the model, the data and its split, the data order and what the gradients go through.
May change (applied, each difference logged): everything else, e.g. ``trainer.epochs``,
``trainer.log_every``, checkpoint keys, ``logger``, and the optimizer's hyperparameters,
which are written into every parameter group of the restored optimizer.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger(__name__)

MUST_MATCH = ("model", "data", "seed", "hooks", "init", "optimizer._target_", "trainer.accumulate",
              "trainer.hook_stage", "trainer.precision", "trainer.strategy")
NOT_ARGUMENTS = ("_target_", "_partial_")


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """{"a.b": leaf} for a nested dict (lists and other values are leaves)."""
    if not isinstance(tree, dict) or (prefix and not tree):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for k, v in tree.items():
        out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def _under(key: str, prefixes) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def compare(saved: dict[str, Any], new: dict[str, Any], accept=()) -> dict[str, tuple[Any, Any]]:
    """The differences a resume may apply ({key: (old, new)}); a ``ValueError`` naming every
    must-match difference that ``accept`` does not name."""
    old, cur = flatten(saved or {}), flatten(new)
    diffs = {k: (old.get(k, "<unset>"), cur.get(k, "<unset>")) for k in sorted(old.keys() | cur.keys())
             if old.get(k, "<unset>") != cur.get(k, "<unset>")}
    refused = [k for k in diffs if _under(k, MUST_MATCH) and not _under(k, accept)]
    if refused:
        listed = "; ".join(f"{k}: {diffs[k][0]!r} -> {diffs[k][1]!r}" for k in refused)
        raise ValueError(f"trainer.resume: the checkpoint's run differs in what must match ({listed}); "
                         f"resume with the same values, or accept them with trainer.resume_accept=[{','.join(refused)}]")
    for k, (a, b) in diffs.items():
        log.info("resume: %s %r -> %r%s", k, a, b, " (accepted)" if _under(k, MUST_MATCH) else "")
    return diffs


def apply_optimizer(optimizer: torch.optim.Optimizer, diffs: dict[str, tuple[Any, Any]]) -> None:
    """Write changed optimizer hyperparameters (``optimizer.lr``, ...) into every param group,
    over the values the checkpoint's optimizer state restored."""
    for key, (_, value) in diffs.items():
        name = key.partition(".")[2]
        if not key.startswith("optimizer.") or name in NOT_ARGUMENTS:
            continue
        for group in optimizer.param_groups:
            if name in group:
                group[name] = tuple(value) if isinstance(group[name], tuple) else value
