"""``gradmod.optimizer(model, spec)``: the optimizer a spec describes (a mapping like the
config's ``optimizer`` node: ``_target_``, its arguments, ``no_decay``, ``groups``), for one's
own loop, Lightning's ``configure_optimizers`` and ``transformers.Trainer(optimizers=...)``.
One torch optimizer, or a ``CombinedOptimizer`` when an entry has an optimizer of its own."""

from __future__ import annotations

from typing import Any, Mapping

from torch import nn
from torch.optim import Optimizer

from gradmod.hooks.rules.globs import param_kinds, shown
from gradmod.optim.combined import CombinedOptimizer
from gradmod.optim.param_groups import Part, check_arguments, locate, plan

SPEC_KEYS = ("_target_", "_partial_", "args", "no_decay", "groups")
UNSET_IS_DEFAULT = ("fused", "foreach")  # null: torch's own choice (left out of the call)


def optimizer(model: nn.Module, spec: Mapping[str, Any]) -> Optimizer:
    """Every parameter of ``model`` (trainable now or not: one unfrozen later trains) in the
    optimizer ``spec`` describes; e.g. ``{"_target_": "torch.optim.AdamW", "lr": 3e-4,
    "groups": [{"params": "@matrices", "optimizer": {"_target_": "torch.optim.Muon"}}]}``."""
    if not isinstance(spec, Mapping) or not spec.get("_target_"):
        raise ValueError(f"optimizer: {shown(spec)} must be a mapping with a _target_, e.g. torch.optim.AdamW")
    base = locate(spec["_target_"], "optimizer")
    kwargs = {k: v for k, v in spec.items() if k not in SPEC_KEYS}
    kwargs.update(spec.get("args") or {})
    kwargs = {k: v for k, v in kwargs.items() if not (k in UNSET_IS_DEFAULT and v is None)}
    check_arguments(base, kwargs, "optimizer")
    parts = plan(
        model.named_parameters(),
        param_kinds(model),
        base,
        kwargs,
        no_decay=spec.get("no_decay") or (),
        entries=list(spec.get("groups") or ()),
    )
    return build(parts)


def build(parts: list[Part]) -> Optimizer:
    """The planned optimizers, as one; a constructor's refusal is one line naming its config node."""
    if not parts:
        raise ValueError("optimizer: the model has no parameters to optimize")
    made = []
    for part in parts:
        try:
            made.append(part.cls(part.groups, **part.kwargs))
        except (ValueError, TypeError, RuntimeError) as e:
            raise ValueError(f"{part.where} ({part.cls.__name__}): {' '.join(str(e).split())}") from None
    return made[0] if len(made) == 1 else CombinedOptimizer(made)
