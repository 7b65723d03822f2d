"""Run train.py, signalled at a point named by GRADMOD_KILL_AT (the soak and resume tests).

``step:N``: right after optimizer step N (its step-end callbacks done, as a crash between
steps). ``write:N``: during the N-th checkpoint write, after the temporary file is written
and before the rename. ``GRADMOD_KILL_SIGNAL``: KILL (default), TERM or INT.
``GRADMOD_KILL_RANK`` (under torchrun): only that rank is signalled (default: every rank).
"""

import os
import runpy
import signal
import sys
from pathlib import Path

from gradmod.run.folder import checkpoint_file as checkpoint
from gradmod.training.callbacks import Callback
from gradmod.training.trainer import Trainer

event, n = os.environ["GRADMOD_KILL_AT"].split(":")
n = int(n)


SIGNAL = signal.Signals["SIG" + os.environ.get("GRADMOD_KILL_SIGNAL", "KILL")]


def die() -> None:
    if os.environ.get("GRADMOD_KILL_RANK", os.environ.get("RANK", "0")) == os.environ.get("RANK", "0"):
        os.kill(os.getpid(), SIGNAL)


class KillAfterStep(Callback):
    def on_step_end(self, trainer) -> None:
        if trainer.step == n:
            die()


if event == "step":
    fit = Trainer.fit

    def with_killer(self, *args, **kwargs):
        self.callbacks.append(KillAfterStep())  # last: the step's other callbacks are done
        return fit(self, *args, **kwargs)

    Trainer.fit = with_killer
else:
    replace, writes = checkpoint.os.replace, [0]

    def replace_or_die(src, dst):
        if Path(src).name.startswith(".step-"):  # a checkpoint, not another run file
            writes[0] += 1
            if writes[0] == n:
                die()
        replace(src, dst)

    checkpoint.os.replace = replace_or_die

root = Path(__file__).resolve().parents[2]
sys.argv = [str(root / "train.py"), *sys.argv[1:]]
sys.path.insert(0, str(root))
runpy.run_path(str(root / "train.py"), run_name="__main__")
