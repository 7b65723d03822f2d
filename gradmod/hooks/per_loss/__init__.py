"""The per_loss stage: several losses, one update per rule (PCGrad, MGDA, CAGrad, UPGrad, ...).

``stage`` runs it: the task Gramian per layer (``gramian``) and one weighted update;
``loss_rules`` groups and checks its rules; ``methods``, ``nash_mtl`` and ``weightings``
hold the methods (``gradmod.register(name, factory, kind="per_loss")`` adds one of one's own).
"""

from gradmod.hooks.per_loss.loss_rules import LossRule
from gradmod.hooks.per_loss.methods import is_method, names
from gradmod.hooks.per_loss.stage import PerLossStage

__all__ = ["LossRule", "PerLossStage", "is_method", "names"]
