"""The per_loss stage: several losses, one update per rule (PCGrad, MGDA, CAGrad, UPGrad, ...).

``stage`` computes the task Gramian per layer and applies one weighted update; ``methods``
holds the methods by name (``register`` adds one of one's own).
"""

from gradmod.hooks.per_loss.methods import is_method, names, register
from gradmod.hooks.per_loss.stage import LossRule, PerLossStage

__all__ = ["LossRule", "PerLossStage", "is_method", "names", "register"]
