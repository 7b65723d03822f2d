"""Objects named by a dotted path in the config (``_target_``), built without Hydra."""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Iterable

import torch


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


def build_optimizer(cfg: Any, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """``optimizer._target_`` called with the parameters and the node's other keys."""
    cls = locate(cfg._target_, "optimizer._target_")
    return cls(params, **arguments(cfg))
