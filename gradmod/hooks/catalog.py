"""The shipped transforms, registered in one place (in the order ``accepted_at`` lists them).

The modules that define them register nothing when imported; the registry loads this
module on its first read (``registry.entries``), so every shipped name is there whoever
asks first, and a user's ``gradmod.register`` meets them (a clash is refused, not lost).
"""

from __future__ import annotations

import torch

from gradmod.hooks import transforms as T
from gradmod.hooks.fused.group import AGC, Freeze, GlobalNormClip, GroupTransform
from gradmod.hooks.fused.norm_history import AutoClip, ZClip
from gradmod.hooks.per_loss import methods as M
from gradmod.hooks.per_loss import weightings as W
from gradmod.hooks.per_loss.nash_mtl import NashMTL
from gradmod.hooks.per_sample.scores import Scores
from gradmod.hooks.per_sample.stats import PerSampleClip, per_sample_log
from gradmod.hooks.registry import FACTORY_BASES, add_stage_form, register
from gradmod.hooks.sharpness.perturb import Asam, Sam
from gradmod.hooks.stats import log
from gradmod.hooks.validators import number

# The kinds whose factories are classes of a base: one's own subclass needs no ``kind=``.
FACTORY_BASES.update(group=GroupTransform, per_loss=M.Method)

# Element-wise: grad -> Tensor | None, with an in-place form over a list of .grad where one pays.
register("clamp", T.clamp, foreach=T.clamp_foreach)
register("zero", T.zero, foreach=lambda: torch._foreach_zero_)
register("min_zero", T.min_zero, foreach=lambda: lambda grads: torch._foreach_clamp_min_(grads, 0.0))
register(
    "scale", T.scale, foreach=lambda factor: lambda grads: torch._foreach_mul_(grads, number("scale", "factor", factor))
)
register("sign", T.sign, foreach=lambda: torch._foreach_sign_)
register("centralize", T.centralize)
register("norm_clip", T.norm_clip)
register("noise", T.noise)
register("log", log, observer=True)

# Per example (the per_sample stage); ``log`` there keeps per-example statistics.
register("per_sample_clip", PerSampleClip, kind="per_sample")
register("scores", Scores, kind="per_sample")  # GraNd and EL2N by dataset index
add_stage_form("log", "per_sample", per_sample_log)

# Per loss: the methods that turn k task gradients (or k losses) into one update.
PER_LOSS = (
    *(M.Mean, M.Sum, M.Fixed, M.Random),  # weights that need no task gradient: run as loss weightings
    *(M.PCGrad, M.MGDA, M.IMTLG, M.AlignedMTL, M.UPGrad, M.DualProj, M.CAGrad, M.GradVac),
    *(NashMTL, M.GradDrop),
    *(W.GeometricMean, W.UW, W.FAMO, W.DWA),  # loss weightings: from the loss values alone
)
for _method in PER_LOSS:
    register(_method.name, _method, kind="per_loss")

# Group: all of a rule's accumulated .grad at once (the fused stage).
register("global_norm_clip", GlobalNormClip, kind="group")
register("agc", AGC, kind="group")
register("zclip", ZClip, kind="group")
register("autoclip", AutoClip, kind="group")
register("freeze", Freeze, kind="group")

# Sharpness: how a rule's parameters move before the second forward and backward.
register("sam", Sam, kind="sharpness")
register("asam", Asam, kind="sharpness")
