"""The per_loss stage: several losses, one update per rule (PCGrad, MGDA, CAGrad, UPGrad, ...).

``stage`` runs it as its phases: the task gradients of each rule's entries (``task_grads``,
``entries``), each rule's update from them (``combine``), the rest's backward (``rest``),
each handed the call's frozen ``backward.Backward``; ``saved`` holds what the forward left,
``reach`` the walks of the autograd graph from the losses. ``loss_rules`` groups and checks
its rules; ``methods/`` holds the methods, a file per family
(``gradmod.register(name, factory, kind="per_loss")`` adds one of one's own).
"""

from gradmod.hooks.per_loss.loss_rules import LossRule
from gradmod.hooks.per_loss.methods.bases import is_method, names
from gradmod.hooks.per_loss.stage import PerLossStage

__all__ = ["LossRule", "PerLossStage", "is_method", "names"]
