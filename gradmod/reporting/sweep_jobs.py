"""What each job of a sweep did, as the job itself recorded it: ``SWEEP/.gradmod/jobs/N.json``.

A job folder can hold an earlier sweep's results (a re-run into the same sweep folder whose
jobs are refused leaves them untouched), and a killed job writes no summary at all, so the
report does not read endings from job folders. Each job writes its own record instead, in
the sweep folder (never in its run folder, which a refused run must leave as it was):

* at its start: ``{"status": "running", "job", "overrides", "pid", "host", "started"}``;
* at its end: the status (``ok``, ``failed``, ``refused``, ``interrupted``, ``killed``, ...),
  the error, and the numbers of the summary the job returned.

The sweep callback empties the folder when a multirun starts, so the records are this
sweep's only. A record still ``running`` after the sweep ended is a job whose process died
without a word (the launcher's worker killed): it is reported as ``killed``.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any, Mapping

JOBS = Path(".gradmod") / "jobs"
NUMBERS = ("test_accuracy", "test_loss", "test_metric", "tasks", "train_loss", "seconds", "steps", "skipped_steps",
           "nonfinite_steps", "epochs", "signal")  # tasks: {name: {test_loss, test_metric}} of a multi-task run


def jobs_dir(sweep_dir: str | Path) -> Path:
    return Path(sweep_dir) / JOBS


def clear(sweep_dir: str | Path) -> None:
    """Forget an earlier sweep's records (a multirun into the same folder starts)."""
    shutil.rmtree(jobs_dir(sweep_dir), ignore_errors=True)


def _write(path: Path, record: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, path)  # the report never reads half a record


def start(sweep_dir: str | Path, num: int, job_dir: str | Path, overrides: list[str]) -> dict[str, Any]:
    """Record that job ``num`` (its folder ``job_dir``) starts; returns the record."""
    job = Path(job_dir).resolve()
    try:
        rel = job.relative_to(Path(sweep_dir).resolve()).as_posix()
    except ValueError:  # hydra.sweep.subdir outside the sweep folder
        rel = str(job)
    record = {"num": num, "job": rel, "dir": str(job), "overrides": list(overrides), "status": "running",
              "pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
    _write(jobs_dir(sweep_dir) / f"{num}.json", record)
    return record


def finish(sweep_dir: str | Path, record: dict[str, Any], status: str, summary: Mapping[str, Any] | None,
           error: str = "") -> dict[str, Any]:
    """Record how the job ended: ``status``, its error and the summary's numbers."""
    summary = summary or {}
    record = {**record, "status": status, "error": error or summary.get("error") or "", "ended": time.time(),
              **{k: summary[k] for k in NUMBERS if k in summary}}
    _write(jobs_dir(sweep_dir) / f"{record['num']}.json", record)
    return record


def read(sweep_dir: str | Path, *, ended: bool) -> list[dict[str, Any]] | None:
    """This sweep's job records in job order; None when the sweep folder has none (a sweep
    from before the records, or a folder put together by hand). ``ended``: the sweep is
    over, so a job still ``running`` was killed."""
    folder = jobs_dir(sweep_dir)
    if not folder.is_dir():
        return None
    records = []
    for path in folder.glob("*.json"):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    for r in records:
        if r.get("status") == "running" and (ended or not _alive(r)):
            r["status"] = "killed"
            r["error"] = "the job's process ended without a word (killed by a signal, e.g. the OOM killer's SIGKILL)"
    return sorted(records, key=lambda r: r.get("num", 0))


def _alive(record: Mapping[str, Any]) -> bool:
    """Whether a running job's process still exists (on another host: assume it does)."""
    if record.get("host") != socket.gethostname():
        return True
    try:
        os.kill(int(record["pid"]), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, KeyError, ValueError, TypeError):
        return True
    return True


def written_by(path: Path, record: Mapping[str, Any]) -> bool:
    """Whether the file at ``path`` was written by this job (after it started), not by an
    earlier run of the folder."""
    try:
        return path.stat().st_mtime >= float(record["started"])
    except (OSError, KeyError, TypeError, ValueError):
        return False
