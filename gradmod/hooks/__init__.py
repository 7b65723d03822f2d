"""The hook core: transforms by name, rules that attach them, statistics they gather.

Imports torch only: usable in any training loop, without the trainer or Hydra.
"""

from gradmod.hooks import transforms
from gradmod.hooks.rules import HookSet, attach
from gradmod.hooks.selection import load_rules
from gradmod.hooks.stats import GradStats

__all__ = ["GradStats", "HookSet", "attach", "load_rules", "transforms"]
