"""The hook core: transforms by name (one registry), rules that attach them, the stages
they run at, statistics they gather.

Imports torch only: usable in any training loop, without the trainer or Hydra.
"""

from gradmod.hooks import registry, stages, transforms
from gradmod.hooks.hookset import HookSet, attach
from gradmod.hooks.registry import register
from gradmod.hooks.rules import load_rules
from gradmod.hooks.stats import GradStats

__all__ = ["GradStats", "HookSet", "attach", "load_rules", "register", "registry", "stages", "transforms"]
