"""Every ending of a run in one place: the ``summary.json`` it leaves, its one line, its exit status.

========== ======================================================================== ==========
status     when                                                                     exit
========== ======================================================================== ==========
ok         training finished (``runner`` writes the results)                        0
failed     an error stopped the run; ``error`` is one line, and where the user's    1 or 2
           own code raised it names that file:line (``train.log`` keeps the
           traceback); a rank of many that died is named (``RankLost``). Bad
           input is 2, a file operation, a lost rank or the user's code 1; a
           bug in gradmod keeps its traceback
interrupted SIGINT, SIGTERM or SIGHUP, before or during training: ``signal``,        130, 143,
           ``steps``,                                                                129
           ``checkpoint`` (see ``gradmod.training.interrupt``)
diverged   the loss or a parameter became non-finite, or a gradient did under       3
           ``trainer.nonfinite=raise``: ``step`` is the first such optimizer step
refused    the folder belongs to another run (its results, or its lock): nothing    2
           is written there; the summary is returned (a sweep reports it)
running    the run owns its folder and has not ended; read where no process holds   -
           the folder (``gradmod.reporting.run_summary``), it is ``killed``
killed     the process was killed (SIGKILL, the OOM killer) and wrote nothing:      -
           whoever started it records this one (``killed``), and its ``running``
           summary reads as it
========== ======================================================================== ==========

A run's ending is settled once, as a value (``Ending``): ``gradmod.run.runner.execute``
returns it, the command line turns it into its line and exit status. A run writes its
ending into its folder once it owns it; before that (refused at the
argument checks) only where it replaces no earlier run's files. Every summary goes through
``atomic.write_text`` (a reader never sees half a file) as strict JSON (non-finite numbers: null).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import signal
import sysconfig
import traceback
from pathlib import Path
from typing import Any

from gradmod.reporting import json_text
from gradmod.run.folder import atomic
from gradmod.run.folder.claim import RESERVE, may_write
from gradmod.training.distributed.peers import RankLost
from gradmod.training.interrupt import Interrupted
from gradmod.training.nonfinite import Diverged

STATUSES = ("ok", "failed", "interrupted", "diverged", "refused", "killed")  # and "running", until one of them

_PACKAGE = Path(__file__).resolve().parents[2]  # gradmod/
_LIBRARIES = tuple({Path(sysconfig.get_paths()[k]).resolve() for k in ("stdlib", "platstdlib", "purelib", "platlib")})


@dataclasses.dataclass(frozen=True)
class Ending:
    """How a run ended: its summary, and the error that ended it (None: ok)."""

    summary: dict[str, Any]
    error: BaseException | None = None

    @property
    def status(self) -> str:
        return str(self.summary.get("status"))

    @property
    def exit_code(self) -> int | None:
        """0 for ok; None for a bug in gradmod (its traceback is kept)."""
        return 0 if self.error is None else exit_status(self.error)

    def result(self) -> dict[str, Any]:
        """The summary of a run that ended ok; else its error, raised."""
        if self.error is not None:
            raise self.error
        return self.summary


def write(out: str | Path, summary: dict[str, Any]) -> None:
    """``out/summary.json``, atomically, as strict JSON. On a full disk the run's reserve
    (``.gradmod/reserve``) is given up for it, so the ending is never left ``running``."""
    text = json_text.dumps(summary, indent=2) + "\n"
    try:
        atomic.write_text(Path(out) / "summary.json", text)
    except OSError as e:
        reserve = Path(out) / ".gradmod" / RESERVE
        if e.errno != errno.ENOSPC or not reserve.is_file():
            raise
        reserve.unlink()
        atomic.write_text(Path(out) / "summary.json", text)


def settle(
    out: str | Path | None, error: BaseException, seconds: float, *, owned: bool, previous: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The ending of a run that raised ``error``: written into ``out`` when the run owns it,
    or when it replaces no earlier run's files (``out`` None: this rank writes nothing);
    returned. ``previous``: the ending of the run this one continued, kept in the summary."""
    summary = summary_of(error, seconds) | ({"previous": previous} if previous is not None else {})
    if out is not None and not owned and not may_write(out):
        if isinstance(error, ValueError):  # the folder's lock or results: this run may not use it
            summary.update(status="refused")
    elif out is not None:
        with contextlib.suppress(OSError):  # a full disk or a lost folder: the error itself says so
            write(out, summary)
    return summary


def summary_of(error: BaseException, seconds: float) -> dict[str, Any]:
    """The summary of a run that raised: failed, interrupted or diverged."""
    summary = {"status": "failed", "error": _typed(error), "test_accuracy": None, "test_loss": None, "seconds": seconds}
    if isinstance(error, Interrupted):
        summary.update(
            status="interrupted",
            error=str(error),
            signal=signal.Signals(error.signum).name,
            steps=error.step,
            checkpoint=str(error.checkpoint) if error.checkpoint else None,
        )
    elif isinstance(error, Diverged):
        summary.update(status="diverged", error=str(error), step=error.step)
    if getattr(error, "privacy", None):  # the epsilon the steps before the ending spent
        summary["privacy"] = error.privacy
    return summary


def killed(signum: int, seconds: float) -> dict[str, Any]:
    """The summary of a run killed by ``signum`` before it could write its own."""
    name = signal.Signals(signum).name
    return {
        "status": "killed",
        "error": f"killed by {name}",
        "signal": name,
        "test_accuracy": None,
        "test_loss": None,
        "seconds": seconds,
    }


def message(error: BaseException) -> str:
    """The one line the terminal shows for an ending that is not a bug."""
    if isinstance(error, OSError):
        return describe_os_error(error)
    if isinstance(error, RankLost):
        return str(error)
    where = user_frame(error)
    if where is not None:
        return f"{_typed(error)} (raised in {where}; the traceback is in train.log)"
    return one_line(str(error))


def exit_status(error: BaseException) -> int | None:
    """The process's exit status for ``error``; None for a bug in gradmod (keep its traceback)."""
    if isinstance(error, Interrupted):
        return error.exit_code
    if isinstance(error, Diverged):
        return 3
    if isinstance(error, (OSError, RankLost)) or user_frame(error) is not None:
        return 1
    if isinstance(error, ValueError):
        return 2
    return None


def describe_os_error(e: OSError) -> str:
    """One line for a failed file operation, naming the path."""
    where = f" {e.filename}" if e.filename else ""
    return f"cannot write{where}: {e.strerror or e}"


def user_frame(error: BaseException) -> str | None:
    """``file:line`` of the user's own code that raised ``error``: the innermost frame that is
    neither gradmod nor an installed library or the standard library (None: not the user's)."""
    for frame, line in reversed(list(traceback.walk_tb(error.__traceback__))):
        path = Path(frame.f_code.co_filename).resolve()
        if path.is_relative_to(_PACKAGE) or path.name == "train.py" or not path.is_file():
            return None  # gradmod's own check, or code run from a string
        if not any(path.is_relative_to(lib) for lib in _LIBRARIES):
            return f"{path}:{line}"
    return None


def one_line(text: str) -> str:
    """A multi-line message (a state-dict error's key lists) as one line, nothing cut."""
    return " ".join(ln.strip() for ln in text.splitlines() if ln.strip())


def _typed(error: BaseException) -> str:
    return f"{type(error).__name__}: {one_line(str(error))}"
