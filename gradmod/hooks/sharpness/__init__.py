"""The sharpness stage: sharpness-aware minimisation (SAM, ASAM, SAM-ON, GSAM, WSAM,
LookSAM, Friendly SAM) by glob.

``perturb`` holds the base of the transforms and ``sam``, ``asam`` (the shift ``e`` of a
rule's parameters); ``gsam``, ``wsam``, ``looksam``, ``friendly_sam`` one each;
``centralize`` the form of ``centralize`` before the ascent; ``stage`` the two passes,
``passes`` what they hold (``gradmod.hooks.second_pass``: what keeps the second pass out of
``.grad`` and the running statistics).
"""

from gradmod.hooks.second_pass import running_stats_frozen
from gradmod.hooks.sharpness.friendly_sam import FriendlySam
from gradmod.hooks.sharpness.gsam import Gsam
from gradmod.hooks.sharpness.looksam import LookSam
from gradmod.hooks.sharpness.passes import SharpRule, sharpness_rules
from gradmod.hooks.sharpness.perturb import Asam, Ascent, Perturbation, Sam
from gradmod.hooks.sharpness.stage import SharpnessStage
from gradmod.hooks.sharpness.wsam import Wsam

__all__ = [
    "Asam",
    "Ascent",
    "FriendlySam",
    "Gsam",
    "LookSam",
    "Perturbation",
    "Sam",
    "SharpRule",
    "SharpnessStage",
    "Wsam",
    "running_stats_frozen",
    "sharpness_rules",
]
