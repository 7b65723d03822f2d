"""Forward-hook tools: shapes, features, recorded activations/gradients, Grad-CAM, summary.

Every tool keeps the handles it registers and removes them when done (a `try/finally`
for one-shot functions, `remove()` / `with` for the classes), so `list_hooks(model)`
reads the same before and after.
"""

from gradmod.capture.features import FeatureExtractor, Recorder, grad_cam, trace_shapes
from gradmod.capture.listing import HookEntry, HookListing, list_hooks, summary, summary_rows

__all__ = [
    "trace_shapes",
    "FeatureExtractor",
    "Recorder",
    "grad_cam",
    "summary",
    "summary_rows",
    "list_hooks",
    "HookEntry",
    "HookListing",
]
