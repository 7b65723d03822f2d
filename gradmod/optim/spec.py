"""``gradmod.optimizer(model, spec)``: the optimizer a spec describes (a mapping like the
config's ``optimizer`` node: ``_target_``, its arguments, ``no_decay``, ``groups``, ``layer_decay``), for one's
own loop, Lightning's ``configure_optimizers`` and ``transformers.Trainer(optimizers=...)``.
One torch optimizer, or a ``CombinedOptimizer`` when an entry has an optimizer of its own.
``check(spec)``: what can be refused before the model exists, as the run's config check does."""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn
from torch.optim import Optimizer

from gradmod.hooks.rules.globs import param_kinds, shown
from gradmod.optim import trust_ratio
from gradmod.optim.combined import CombinedOptimizer
from gradmod.optim.layer_decay import factor_of
from gradmod.optim.param_groups import (
    AS_ONE,
    Part,
    check_arguments,
    check_step,
    check_values,
    entries_of,
    entry_plan,
    optimizer_class,
    plan,
)

SPEC_KEYS = ("_target_", "_partial_", "args", "no_decay", "groups", "layer_decay")
UNSET_IS_DEFAULT = ("fused", "foreach")  # null: torch's own choice (left out of the call)
PLAN_KEYS = ("_target_", "no_decay", "groups", "layer_decay")  # what decides the optimizers and their groups
BASE_EXAMPLE = "torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD"


def optimizer(model: nn.Module, spec: Mapping[str, Any]) -> Optimizer:
    """Every parameter of ``model`` (trainable now or not: one unfrozen later trains) in the
    optimizer ``spec`` describes; e.g. ``{"_target_": "torch.optim.AdamW", "lr": 3e-4,
    "groups": [{"params": "@matrices", "optimizer": {"_target_": "torch.optim.Muon"}}]}``."""
    base, kwargs = base_of(spec)
    parts = plan(
        model.named_parameters(),
        param_kinds(model),
        base,
        kwargs,
        no_decay=spec.get("no_decay") or (),
        entries=spec.get("groups") or [],
        layer_decay=spec.get("layer_decay"),
    )
    return build(parts)


def base_of(spec: Mapping[str, Any]) -> tuple[type, dict[str, Any]]:
    """The base optimizer's class and keyword arguments: the spec's keys but ``SPEC_KEYS``, then
    ``args``, then ``fused``/``foreach`` where set."""
    if not isinstance(spec, Mapping) or not spec.get("_target_"):
        raise ValueError(f"optimizer: {shown(spec)} must be a mapping with a _target_, e.g. torch.optim.AdamW")
    base = optimizer_class(spec["_target_"], "optimizer._target_", BASE_EXAMPLE)
    kwargs = {k: v for k, v in spec.items() if k not in SPEC_KEYS and k not in UNSET_IS_DEFAULT}
    kwargs.update(spec.get("args") or {})
    kwargs.update({k: spec[k] for k in UNSET_IS_DEFAULT if spec.get(k) is not None})
    check_arguments(base, kwargs, "optimizer")
    check_values(base, kwargs, "optimizer")
    return base, kwargs


def check(spec: Mapping[str, Any]) -> None:
    """Refuse, in one line, what ``optimizer(model, spec)`` would refuse before it reads the
    model: the classes, arguments and values of the base optimizer and of every entry (each
    optimizer is tried on a dummy parameter, so its constructor checks its values too). What an
    entry's globs match is the model's: ``optimizer`` finds it."""
    base, kwargs = base_of(spec)
    factor_of(spec.get("layer_decay"))
    _made(base, [torch.zeros(1, requires_grad=True)], kwargs, "optimizer")
    entries = [entry_plan(i, e, base, kwargs) for i, e in enumerate(entries_of(spec.get("groups") or []))]
    for entry in entries:
        if entry.cls is None:  # the base optimizer given the entry's arguments, for its constructor's checks
            args = {k: entry.options[k] for k in (*entry.options["entry_args"], "lr") if k in entry.options}
            _made(base, [torch.zeros(1, requires_grad=True)], {**kwargs, **args}, entry.where)
        else:  # a matrix: Muon takes nothing else (with rows for every block of its split)
            k = entry.kwargs.get("split", 1)
            rows = 2 * (k if isinstance(k, int) and not isinstance(k, bool) and k > 0 else 1)
            _made(entry.cls, [torch.zeros(rows, 2, requires_grad=True)], entry.kwargs, entry.where)
    if any(e.cls is not None for e in entries):
        check_step(base, "optimizer._target_", AS_ONE)


def build(parts: list[Part]) -> Optimizer:
    """The planned optimizers, as one; a constructor's refusal is one line naming its config node."""
    if not parts:
        raise ValueError("optimizer: the model has no parameters to optimize")
    if len(parts) > 1:
        for part in parts:
            check_step(part.cls, f"{part.where}._target_", AS_ONE)
    made = [_made(part.cls, part.groups, part.kwargs, part.where) for part in parts]
    for opt in made:
        trust_ratio.attach(opt)
    return made[0] if len(made) == 1 else CombinedOptimizer(made)


def _made(cls: type, params: Any, kwargs: Mapping[str, Any], where: str) -> Optimizer:
    """``cls(params, **kwargs)``; its refusal is one line naming ``where``, the config node."""
    try:
        return cls(params, **kwargs)
    except Exception as e:  # a user's class may refuse with any error
        raise ValueError(f"{where} ({cls.__name__}): {' '.join(str(e).split())}") from None
