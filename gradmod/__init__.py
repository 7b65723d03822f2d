"""gradmod: gradient manipulation through PyTorch hooks.

The hook core (``gradmod.hooks``: transforms, rules, statistics) imports torch only, so
``gradmod.attach`` works in any training loop; the Hydra runner lives in ``gradmod.app``.
"""

from gradmod.capture import FeatureExtractor, Recorder, grad_cam, list_hooks, summary, trace_shapes
from gradmod.hooks import HookSet, attach, transforms
from gradmod.weight_init import apply_init

__all__ = [
    "FeatureExtractor", "HookSet", "Recorder", "apply_init", "attach", "grad_cam", "list_hooks",
    "summary", "trace_shapes", "transforms",
]
__version__ = "0.3.0.dev0"  # the one version source (pyproject reads it)
