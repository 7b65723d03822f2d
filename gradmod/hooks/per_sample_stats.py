"""Kept for imports of the former path: the module is ``gradmod.hooks.per_sample.stats``."""

import sys

from gradmod.hooks.per_sample import stats as _module

sys.modules[__name__] = _module
