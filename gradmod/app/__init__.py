"""The Hydra application: typed config schemas and the command-line job behind ``train.py``.

The only package (besides ``./train.py``) that imports hydra or omegaconf.
"""

# Sweep jobs fork (``isolated``), which is only safe before torch starts its thread pools:
# importing it with the package counts the threads there are before any torch work.
from gradmod.app import isolated as _isolated  # noqa: E402, F401
