"""Kept for imports of the former path: the module is ``gradmod.hooks.per_sample.layers``."""

import sys

from gradmod.hooks.per_sample import layers as _module

sys.modules[__name__] = _module
