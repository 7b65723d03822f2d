"""gradmod: gradient manipulation through PyTorch hooks.

The library's face (``__all__``): ``attach`` rules to a model and get the ``HookSet`` that
holds every handle, ``load_rules`` reads them from a hook config file, ``optimizer(model,
spec)`` builds the optimizer by glob (groups, several optimizers as one), and extending gradmod
goes through one door: ``register(name, factory, kind=...)`` for a transform of any kind
(``elementwise``, ``group``, ``per_sample``, ``per_loss``, ``sharpness``), the base classes
``GroupTransform`` (a group transform) and ``Method`` (a per_loss method), and
``register_form(layer_type, form)`` with ``Form`` for a layer's per-example gradients.

The rest is reached through its module: the hook core ``gradmod.hooks`` (imports torch
only, so ``attach`` works in any training loop), the article tools ``gradmod.capture``, the
optimizer room ``gradmod.optim``, the Hydra runner ``gradmod.app``. ``PoissonSampler``, ``Accountant`` and ``epsilon``
(``gradmod.training.accounting``), the pieces of DP-SGD in one's own loop, answer here too.
The names load on first use, so that the command line checks a config before torch loads.
"""

from __future__ import annotations

import importlib
from typing import Any

_FACE = {
    "HookSet": "gradmod.hooks",
    "attach": "gradmod.hooks",
    "load_rules": "gradmod.hooks",
    "register": "gradmod.hooks.registry",
    "GroupTransform": "gradmod.hooks.fused.group",
    "Method": "gradmod.hooks.per_loss.methods.bases",
    "Form": "gradmod.hooks.per_sample.forms.base",
    "register_form": "gradmod.hooks.per_sample.forms.layers",
    "optimizer": "gradmod.optim",
}
# Named by the privacy guide and by the one line that refuses DP-SGD under another trainer.
_OWN_LOOP = {name: "gradmod.training.accounting" for name in ("Accountant", "PoissonSampler", "epsilon")}
_HOMES = {**_FACE, **_OWN_LOOP}
__all__ = sorted(_FACE)
__version__ = "0.3.0.dev0"  # the one version source (pyproject reads it)


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'gradmod' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])
