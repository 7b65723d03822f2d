"""Train with gradient hooks from Hydra configs: ``python train.py +hooks=clip``, the same
as the installed console script ``gradmod +hooks=clip``."""

import signal

from gradmod.app import interrupted_at_start  # light: no torch, no Hydra yet

signal.signal(signal.SIGINT, interrupted_at_start)  # Ctrl-C while they import: one line

from gradmod.app.cli import main  # noqa: E402

if __name__ == "__main__":
    main()  # the shipped configs, gradmod/conf/; every ending one line on stderr and an exit status
