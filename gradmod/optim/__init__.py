"""The update by glob: optimizer groups chosen with the rules' globs and selectors
(``param_groups``), several optimizers as one (``CombinedOptimizer``), ``optimizer(model,
spec)`` to build them (the run's builder too; ``spec.check``: its checks before the model
exists), a ``Muon`` that also takes convolution kernels, an ``Adam`` that may leave out bias
correction (LAMB's), and ``trust_ratio`` by group (LARS, LARC, LAMB). Imports torch and
``gradmod.hooks.rules.globs`` only: usable in one's own loop, Lightning and Hugging Face's Trainer."""

from __future__ import annotations

from typing import Any

from gradmod.optim.adam import Adam
from gradmod.optim.combined import CombinedOptimizer
from gradmod.optim.spec import optimizer

__all__ = ["Adam", "CombinedOptimizer", "Muon", "optimizer"]


def __getattr__(name: str) -> Any:
    if name == "Muon":  # torch.optim.Muon's subclass: loaded on use
        from gradmod.optim.muon import Muon

        return Muon
    raise AttributeError(f"module 'gradmod.optim' has no attribute {name!r}")
