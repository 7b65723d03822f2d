"""gradmod: gradient manipulation through PyTorch hooks, driven by Hydra configs."""

from gradmod import config, transforms
from gradmod.rules import HookSet, attach

__all__ = ["HookSet", "attach", "transforms"]
__version__ = "0.1.0"
