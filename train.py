"""Train with gradient hooks from Hydra configs: ``python train.py +hooks=clip``, the same
as the installed console script ``gradmod +hooks=clip``."""

import signal
import sys


def _interrupted(signum, frame):  # Ctrl-C while torch imports or Hydra composes: one line, not a traceback
    print("interrupted by SIGINT before training started", file=sys.stderr)
    sys.exit(128 + signum)


signal.signal(signal.SIGINT, _interrupted)  # the run and the sweep install their own handlers

from gradmod.app.cli import main  # noqa: E402

if __name__ == "__main__":
    main()  # the shipped configs, gradmod/conf/; every ending one line on stderr and an exit status
