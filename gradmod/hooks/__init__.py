"""The hook core: transforms by name (one registry), rules that attach them, the stages
they run at (``stage.Stage``, one folder each), statistics they gather.

Imports torch only: usable in any training loop, without the trainer or Hydra. The names
below load on first use, so that the torch-free tables (``stages``, ``registry``) can be
read by the command line before torch loads.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "HookSet": "gradmod.hooks.hookset",
    "attach": "gradmod.hooks.hookset",
    "load_rules": "gradmod.hooks.rules.targets",
    "GradStats": "gradmod.hooks.stats.grad_stats",
    "Stage": "gradmod.hooks.stage",
    "curvature": "gradmod.hooks.hessian.estimate",
}
_MODULES = ("registry", "stages", "transforms")
__all__ = sorted([*_HOMES, *_MODULES])


def __getattr__(name: str) -> Any:
    if name in _MODULES:
        value = importlib.import_module(f"gradmod.hooks.{name}")
    elif name in _HOMES:
        value = getattr(importlib.import_module(_HOMES[name]), name)
    else:
        raise AttributeError(f"module 'gradmod.hooks' has no attribute {name!r}")
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
