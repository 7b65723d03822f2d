"""The per_sample stage: each example's gradient, clipped, summed and noised (DP-SGD).

``stage`` runs it (``sample_rules``: its rules and what they refuse); ``forms/`` holds every
layer type's per-example form (``register_form`` adds one); ``assign`` decides (from
``gradmod.hooks.trace.first_forward``) which module call answers for each parameter; ``accounts``
and ``probes`` check that every gradient is accounted for; ``detached_weights`` spares autograd's
batch weight gradient where the stage forms it; ``stats`` holds ``per_sample_clip`` and the
per-example ``log``, ``scores`` GraNd and EL2N; ``replace_batchnorm`` makes a BatchNorm model usable.
"""

from gradmod.hooks.groupnorm import replace_batchnorm
from gradmod.hooks.per_sample.forms.layers import Form, register_form
from gradmod.hooks.per_sample.sample_rules import check_model, per_sample_rules
from gradmod.hooks.per_sample.stage import PerSampleStage

__all__ = ["Form", "PerSampleStage", "check_model", "per_sample_rules", "register_form", "replace_batchnorm"]
