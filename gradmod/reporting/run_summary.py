"""``summary.json`` as its readers take it.

From the moment a run owns its folder, ``summary.json`` says ``running`` (with the ending
of the run it continues under ``previous``) until the run writes its own ending. The run
holds the folder's lock (``.gradmod/lock``, ``fcntl.flock``: released by the kernel however
the process ends) for its whole life, so a summary that says ``running`` while no process
holds the lock belongs to a run that was killed (SIGKILL, the OOM killer) before it could
write its ending: ``read`` gives it as ``killed``, for ``resume=auto``, the sweep report
and anyone else reading the folder.
"""

from __future__ import annotations

import fcntl
import json
from pathlib import Path
from typing import Any

LOCK = Path(".gradmod") / "lock"
KILLED = (
    "the run's process ended while it was running, without writing its ending (killed by a signal, "
    "e.g. SIGKILL or the OOM killer)"
)


def in_use(out: str | Path) -> bool:
    """Whether a process holds the folder's lock now."""
    path = Path(out) / LOCK
    if not path.is_file():
        return False
    with open(path) as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
    return False


def as_ended(summary: Any) -> Any:
    """A ``running`` summary of a run that no longer holds its folder, as what it is: killed."""
    if isinstance(summary, dict) and summary.get("status") == "running":
        return {**summary, "status": "killed", "error": KILLED}
    return summary


def read(out: str | Path, *, holding: bool = False) -> Any:
    """``out/summary.json`` (None when missing or not JSON); ``running`` reads as ``killed``
    unless a live run holds the folder. ``holding``: the caller holds the lock itself, so
    no other run is alive there."""
    try:
        summary = json.loads((Path(out) / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    return as_ended(summary) if holding or not in_use(out) else summary
