"""SIGINT, SIGTERM and SIGHUP end a run cleanly: the step in progress finishes, a checkpoint is
written, and ``Interrupted`` carries the signal out (``summary.json`` status
``interrupted``; the command line exits 128 + the signal's number: 130, 143, 129).
Before training starts (data loading, model build, checkpoint checks) there is no step to
finish: the signal stops the run at once, as does a second Ctrl-C during training; both
are ``Interrupted`` too, never a traceback. With many processes, a signal to any rank
stops every rank at the same step, agreed at each step's end."""

from __future__ import annotations

import contextlib
import shlex
import signal
import threading
from pathlib import Path
from typing import Iterator

from gradmod.training.callbacks import Callback

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # SIGHUP: the controlling terminal closed


class Interrupted(BaseException):
    """A run stopped by a signal after ``step`` steps (``started``: of its training;
    else before it started); ``checkpoint`` continues it. Like ``KeyboardInterrupt``, not
    an ``Exception``: code that handles errors (the user's, a factory's) lets it through."""

    def __init__(
        self, signum: int, step: int, checkpoint: Path | None, started: bool = True, folder: Path | None = None
    ):
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        again = f" hydra.run.dir={shlex.quote(str(folder))}" if folder is not None else ""  # the same folder
        where = f"checkpoint {checkpoint}; continue with trainer.resume=auto{again}" if checkpoint else "no checkpoint"
        when = f"after step {step}; {where}" if started else "before training started"
        super().__init__(f"interrupted by {signal.Signals(signum).name} {when}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class StopOnSignal(Callback):
    """Notes SIGINT/SIGTERM/SIGHUP (``install``) and stops at the next step's end (or epoch's end),
    after a checkpoint through ``saver`` (a ``Checkpointer``, or None for none); ``folder``,
    the run folder, goes into the line that says how to continue. Installed
    before training, it stops at once until ``on_fit_start``. Last: the step's other
    callbacks are done when it stops the run."""

    last = True

    def __init__(self, saver=None, folder: Path | None = None):
        self.saver, self.signum, self.folder = saver, None, folder
        self.trainer = None  # set when training starts: from then on a signal waits for the step's end

    @contextlib.contextmanager
    def install(self) -> Iterator[None]:
        """Handle the signals while the block runs (main thread only: elsewhere, nothing)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {s: signal.signal(s, self._note) for s in SIGNALS}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _note(self, signum: int, frame) -> None:
        if self.trainer is None:  # nothing to finish yet
            raise Interrupted(signum, 0, None, started=False)
        if self.signum == signal.SIGINT and signum == signal.SIGINT:  # asked twice: stop now
            raise Interrupted(signum, self.trainer.step, None)
        self.signum = signum

    def on_fit_start(self, trainer) -> None:
        self.trainer = trainer
        self._stop_if_asked(trainer, save=False)

    def on_step_end(self, trainer) -> None:
        self._stop_if_asked(trainer)

    def on_epoch_end(self, trainer, record) -> None:
        self._stop_if_asked(trainer)

    def _stop_if_asked(self, trainer, save: bool = True) -> None:
        # Many processes: a signal to any rank stops them all at this same step (one small
        # all-reduce; after the step's optimizer step, so trainer.sync_check allows it).
        signum = trainer.dist.agree(self.signum or 0) if trainer.dist.world_size > 1 else self.signum
        if not signum:
            return
        path = None
        if save and self.saver is not None:
            path = self.saver.save(trainer)  # rank 0 writes (the same step again is an atomic replace)
        raise Interrupted(signum, trainer.step, path, folder=self.folder)
