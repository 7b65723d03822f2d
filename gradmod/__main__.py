"""``python -m gradmod ...``: the console script ``gradmod``, also where an installed package has
no train.py beside it (``torchrun --nproc_per_node=2 -m gradmod trainer.strategy=ddp``); a
checkout's train.py runs this module's ``main``."""

import signal

from gradmod.app import interrupted_at_start  # light: no torch, no Hydra yet

signal.signal(signal.SIGINT, interrupted_at_start)  # Ctrl-C while they import: one line

from gradmod.app.cli import main  # noqa: E402

if __name__ == "__main__":
    main()
