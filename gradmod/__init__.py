"""gradmod: gradient manipulation through PyTorch hooks.

The hook core (``gradmod.hooks``: transforms, rules, statistics) imports torch only, so
``gradmod.attach`` works in any training loop; the Hydra runner lives in ``gradmod.app``.
The names below load on first use, so that the command line checks a config before torch loads.

Extending gradmod goes through this one door: ``register(name, factory, kind=...)`` for a
transform of any kind (``elementwise``, ``group``, ``per_sample``, ``per_loss``), the base
classes ``GroupTransform`` (a group transform) and ``Method`` (a per_loss method), and
``register_form(layer_type, form)`` with ``Form`` for a layer's per-example gradients.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "FeatureExtractor": "gradmod.capture",
    "Recorder": "gradmod.capture",
    "grad_cam": "gradmod.capture",
    "list_hooks": "gradmod.capture",
    "summary": "gradmod.capture",
    "trace_shapes": "gradmod.capture",
    "HookSet": "gradmod.hooks",
    "attach": "gradmod.hooks",
    "transforms": "gradmod.hooks",
    "register": "gradmod.hooks.registry",
    "GroupTransform": "gradmod.hooks.fused.group",
    "Method": "gradmod.hooks.per_loss.methods",
    "Form": "gradmod.hooks.per_sample.form",
    "register_form": "gradmod.hooks.per_sample.layers",
    "optimizer": "gradmod.optim",
    "CombinedOptimizer": "gradmod.optim",
    "apply_init": "gradmod.weight_init",
    "Accountant": "gradmod.training.accounting",
    "PoissonSampler": "gradmod.training.accounting",
    "epsilon": "gradmod.training.accounting",
}
__all__ = sorted(_HOMES)
__version__ = "0.3.0.dev0"  # the one version source (pyproject reads it)


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'gradmod' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])
