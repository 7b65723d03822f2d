"""gradmod: gradient manipulation through PyTorch hooks, driven by Hydra configs."""

from gradmod import config, transforms
from gradmod.capture import FeatureExtractor, Recorder, grad_cam, list_hooks, summary, trace_shapes
from gradmod.init import apply_init
from gradmod.rules import HookSet, attach

__all__ = [
    "FeatureExtractor", "HookSet", "Recorder", "apply_init", "attach", "grad_cam", "list_hooks",
    "summary", "trace_shapes", "transforms",
]
__version__ = "0.1.0"
