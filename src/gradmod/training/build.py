"""Objects named by a dotted path in the config (``_target_``), built without Hydra."""

from __future__ import annotations

import dataclasses
import fnmatch
import importlib
from typing import Any, Iterable

import torch
from torch import nn

from gradmod.hooks.rules import name_hint

# Optimizers with a fused CUDA implementation that gives the same updates (torch's docs).
FUSED_ON_CUDA = ("Adam", "AdamW", "SGD")


def locate(path: str, key: str) -> Any:
    """The object at ``path`` (``package.module.name``); ``key`` names the config entry in errors."""
    module, _, name = str(path).rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"{key}={path!r} does not import ({type(e).__name__}: {e})") from None


def arguments(cfg: Any) -> dict[str, Any]:
    """A config dataclass's fields as keyword arguments, without Hydra's ``_target_``-style keys."""
    return {k: v for k, v in dataclasses.asdict(cfg).items() if not (k.startswith("_") and k.endswith("_"))}


def call_target(key: str, cfg: Any, *args: Any) -> Any:
    """``cfg._target_(*args, **cfg.args)``; a failing call is one line naming ``key``."""
    fn = locate(cfg._target_, f"{key}._target_")
    try:
        return fn(*args, **cfg.args)
    except Exception as e:
        shown = ", ".join(f"{k}={v!r}" for k, v in cfg.args.items())
        raise ValueError(f"{key}._target_={cfg._target_}({shown}) failed: {type(e).__name__}: "
                         f"{' '.join(str(e).split())}") from None


def default_fused(cls: type, device: torch.device) -> bool | None:
    """``optimizer.fused=null``: fused kernels on CUDA for the optimizers that have them
    (one launch for all parameters), torch's own choice elsewhere."""
    if torch.device(device).type == "cuda" and getattr(cls, "__name__", "") in FUSED_ON_CUDA \
            and cls.__module__.startswith("torch.optim"):
        return True
    return None


def param_groups(named: Iterable[tuple[str, nn.Parameter]], no_decay: list[str]) -> list[dict[str, Any]]:
    """Two groups: parameters matching a ``no_decay`` glob get ``weight_decay=0``. A glob
    matching nothing is an error, as in hook rules."""
    named = [(n, p) for n, p in named if p.requires_grad]
    names = [n for n, _ in named]
    exempt: set[str] = set()
    for pattern in no_decay:
        hits = fnmatch.filter(names, pattern)
        if not hits:
            raise ValueError(f"optimizer.no_decay: {pattern!r} matches no parameter; {name_hint(pattern, names)}")
        exempt.update(hits)
    groups = [{"params": [p for n, p in named if n not in exempt]},
              {"params": [p for n, p in named if n in exempt], "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def build_optimizer(cfg: Any, params: Iterable[Any], device: torch.device | str = "cpu") -> torch.optim.Optimizer:
    """``optimizer._target_`` called with the parameters (or ``param_groups``) and the node's
    other keys; ``fused``/``foreach`` only when set (or chosen by ``default_fused``)."""
    cls = locate(cfg._target_, "optimizer._target_")
    kwargs = {k: v for k, v in arguments(cfg).items() if k not in ("no_decay", "args", "fused", "foreach")}
    kwargs.update(cfg.args)
    fused = cfg.fused if cfg.fused is not None or cfg.foreach else default_fused(cls, device)
    for key, value in (("fused", fused), ("foreach", cfg.foreach)):
        if value is not None:
            kwargs[key] = value
    return cls(params, **kwargs)
