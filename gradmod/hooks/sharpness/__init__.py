"""The sharpness stage: sharpness-aware minimisation (SAM, ASAM, SAM-ON) by glob.

``perturb`` holds the transforms (``sam``, ``asam``: the shift ``e`` of a rule's
parameters), ``stage`` the two passes, ``batchnorm`` what keeps the second pass out of the
running statistics.
"""

from gradmod.hooks.sharpness.batchnorm import running_stats_frozen
from gradmod.hooks.sharpness.perturb import Asam, Perturbation, Sam
from gradmod.hooks.sharpness.stage import SharpnessStage, SharpRule, sharpness_rules

__all__ = [
    "Asam",
    "Perturbation",
    "Sam",
    "SharpRule",
    "SharpnessStage",
    "running_stats_frozen",
    "sharpness_rules",
]
