"""The shipped transforms, as a table (in the order ``accepted_at`` lists them).

Each row is ``(name, kind, "module:factory", forms)``, ``forms`` holding what else the entry
has: ``foreach`` (an element-wise transform's in-place form over a list of ``.grad``),
``observer``, ``at_stage`` (stage -> its form there). The table imports nothing: the
registry reads it on its first read (``registry.entries``) and imports a factory's module
when its entry is first used, so every shipped name is there whoever asks first, a user's
``gradmod.register`` meets them (a clash is refused, not lost), and no module is loaded
for a transform no rule names.
"""

_T = "gradmod.hooks.transforms"
_METHODS = "gradmod.hooks.per_loss.methods.bases"
_WEIGHTINGS = "gradmod.hooks.per_loss.methods.loss_weightings"
_GRAMIAN = "gradmod.hooks.per_loss.methods.gramian_weightings"
_AGGREGATORS = "gradmod.hooks.per_loss.methods.aggregators"
_SIMPLEX = "gradmod.hooks.per_loss.methods.simplex_steps"
_SCALARIZATIONS = "gradmod.hooks.per_loss.methods.scalarizations"
_GROUP = "gradmod.hooks.fused.group"
_HISTORY = "gradmod.hooks.fused.norm_history"
_PER_SAMPLE = "gradmod.hooks.per_sample.stats"
_SHARP = "gradmod.hooks.sharpness"
_SHARPNESS = f"{_SHARP}.perturb"

# kind -> the base class whose subclasses are of that kind: one's own subclass needs no ``kind=``.
KIND_BASES = {"group": f"{_GROUP}:GroupTransform", "per_loss": f"{_METHODS}:Method"}
# kind -> the check a class factory of that kind passes when registered.
KIND_CHECKS = {"per_loss": f"{_METHODS}:check_method"}

SHIPPED = (
    # Element-wise: grad -> Tensor | None, with an in-place form over a list of .grad where one pays.
    ("clamp", "elementwise", f"{_T}:clamp", {"foreach": f"{_T}:clamp_foreach"}),
    ("zero", "elementwise", f"{_T}:zero", {"foreach": f"{_T}:zero_foreach"}),
    ("min_zero", "elementwise", f"{_T}:min_zero", {"foreach": f"{_T}:min_zero_foreach"}),
    ("scale", "elementwise", f"{_T}:scale", {"foreach": f"{_T}:scale_foreach"}),
    ("sign", "elementwise", f"{_T}:sign", {"foreach": f"{_T}:sign_foreach"}),
    # ``centralize`` before a sharpness rule's ascent: SAM(use_gc=True).
    (
        "centralize",
        "elementwise",
        f"{_T}:centralize",
        {"at_stage": {"sharpness": f"{_SHARP}.centralize:centralize_ascent"}},
    ),
    ("norm_clip", "elementwise", f"{_T}:norm_clip", {}),
    ("noise", "elementwise", f"{_T}:noise", {}),
    # ``log`` keeps statistics; at the per_sample stage, per-example ones.
    (
        "log",
        "elementwise",
        "gradmod.hooks.stats.grad_stats:log",
        {"observer": True, "at_stage": {"per_sample": f"{_PER_SAMPLE}:per_sample_log"}},
    ),
    # An observer of the loss, not of a gradient: gradmod's trainer runs its rule every N steps.
    ("curvature", "elementwise", "gradmod.hooks.hessian.estimate:curvature_rule", {}),
    # Per example (the per_sample stage).
    ("per_sample_clip", "per_sample", f"{_PER_SAMPLE}:PerSampleClip", {}),
    ("scores", "per_sample", "gradmod.hooks.per_sample.scores:Scores", {}),
    # Per loss: the methods that turn k task gradients (or k losses) into one update. Weights
    # that need no task gradient run as loss weightings (mean, sum, fixed, random).
    ("mean", "per_loss", f"{_WEIGHTINGS}:Mean", {}),
    ("sum", "per_loss", f"{_WEIGHTINGS}:Sum", {}),
    ("fixed", "per_loss", f"{_WEIGHTINGS}:Fixed", {}),
    ("random", "per_loss", f"{_WEIGHTINGS}:Random", {}),
    ("pcgrad", "per_loss", f"{_GRAMIAN}:PCGrad", {}),
    ("mgda", "per_loss", f"{_GRAMIAN}:MGDA", {}),
    ("imtl_g", "per_loss", f"{_GRAMIAN}:IMTLG", {}),
    ("aligned_mtl", "per_loss", f"{_GRAMIAN}:AlignedMTL", {}),
    ("upgrad", "per_loss", f"{_GRAMIAN}:UPGrad", {}),
    ("dualproj", "per_loss", f"{_GRAMIAN}:DualProj", {}),
    ("cagrad", "per_loss", f"{_GRAMIAN}:CAGrad", {}),
    ("gradvac", "per_loss", f"{_GRAMIAN}:GradVac", {}),
    ("nash_mtl", "per_loss", "gradmod.hooks.per_loss.methods.nash_mtl:NashMTL", {}),
    ("config", "per_loss", f"{_AGGREGATORS}:ConFIG", {}),
    ("fairgrad", "per_loss", f"{_AGGREGATORS}:FairGrad", {}),
    ("krum", "per_loss", f"{_AGGREGATORS}:Krum", {}),
    ("pcd", "per_loss", "gradmod.hooks.per_loss.methods.pcd:PCD", {}),
    ("modo", "per_loss", f"{_SIMPLEX}:MoDo", {}),
    ("sdmgrad", "per_loss", f"{_SIMPLEX}:SDMGrad", {}),
    # Smoothing: another method's weights averaged across steps (a Gramian method's, excess_mtl's, a loss weighting's).
    ("crmogm", "per_loss", f"{_SIMPLEX}:CRMOGM", {}),
    # Aggregators: the update from the task gradients themselves.
    ("graddrop", "per_loss", "gradmod.hooks.per_loss.methods.graddrop:GradDrop", {}),
    ("trimmed_mean", "per_loss", f"{_AGGREGATORS}:TrimmedMean", {}),
    ("excess_mtl", "per_loss", f"{_AGGREGATORS}:ExcessMTL", {}),
    # Loss weightings: from the loss values alone.
    ("geometric_mean", "per_loss", f"{_WEIGHTINGS}:GeometricMean", {}),
    ("uw", "per_loss", f"{_WEIGHTINGS}:UW", {}),
    ("famo", "per_loss", f"{_WEIGHTINGS}:FAMO", {}),
    ("dwa", "per_loss", f"{_WEIGHTINGS}:DWA", {}),
    # Scalarizations: the gradient of a function of the losses, one ordinary backward.
    ("cosmos", "per_loss", f"{_SCALARIZATIONS}:COSMOS", {}),
    ("imtll", "per_loss", f"{_SCALARIZATIONS}:IMTLL", {}),
    ("pbi", "per_loss", f"{_SCALARIZATIONS}:PBI", {}),
    ("stch", "per_loss", f"{_SCALARIZATIONS}:STCH", {}),
    # Group: all of a rule's accumulated .grad at once (the fused stage).
    ("global_norm_clip", "group", f"{_GROUP}:GlobalNormClip", {}),
    ("agc", "group", f"{_GROUP}:AGC", {}),
    ("zclip", "group", f"{_HISTORY}:ZClip", {}),
    ("autoclip", "group", f"{_HISTORY}:AutoClip", {}),
    ("freeze", "group", f"{_GROUP}:Freeze", {}),
    ("orthogonalize", "group", "gradmod.hooks.fused.orthogonalize:Orthogonalize", {}),
    # Penalty: a term of the loss's own gradient, added before the backward that fills .grad.
    ("grad_penalty", "penalty", "gradmod.hooks.penalty.terms:GradPenalty", {}),
    ("input_grad_penalty", "penalty", "gradmod.hooks.penalty.terms:InputGradPenalty", {}),
    # Sharpness: how a rule's parameters move before the second forward and backward.
    ("sam", "sharpness", f"{_SHARPNESS}:Sam", {}),
    ("asam", "sharpness", f"{_SHARPNESS}:Asam", {}),
    ("gsam", "sharpness", f"{_SHARP}.gsam:Gsam", {}),
    ("wsam", "sharpness", f"{_SHARP}.wsam:Wsam", {}),
    ("looksam", "sharpness", f"{_SHARP}.looksam:LookSam", {}),
    ("friendly_sam", "sharpness", f"{_SHARP}.friendly_sam:FriendlySam", {}),
)
