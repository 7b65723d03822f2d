"""The Hydra application: typed config schemas and the command-line job behind ``train.py``.

The only package (besides ``./train.py``) that imports hydra or omegaconf.
"""

# Sweep jobs fork (``isolated``), which is only safe before torch starts its thread pools:
# importing it with the package counts the threads there are before any torch work.
import sys

from gradmod.app import isolated as _isolated  # noqa: E402, F401


def interrupted_at_start(signum, frame):
    """SIGINT's handler while torch imports or Hydra composes: one line, not a traceback.
    ``train.py`` installs it before importing the app, ``cli.main`` on entry; the run and
    the sweep then install their own."""
    print("interrupted by SIGINT before training started", file=sys.stderr)
    sys.exit(128 + signum)
