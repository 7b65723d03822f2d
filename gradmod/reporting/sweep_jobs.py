"""What each job of a sweep did, as the job itself recorded it: ``SWEEP/.gradmod/jobs/N.json``.

A job folder can hold an earlier sweep's results (a re-run into the same sweep folder whose
jobs are refused leaves them untouched), and a killed job writes no summary at all, so the
report does not read endings from job folders. Each job writes its own record instead, in
the sweep folder (never in its run folder, which a refused run must leave as it was):

* at its start: ``{"status": "running", "job", "overrides", "pid", "host", "started"}``;
* at its end: the status (``ok``, ``failed``, ``refused``, ``interrupted``, ``killed``, ...),
  the error, and the numbers of the summary the job returned.

The sweep callback empties the folder when a multirun starts, so the records are this
sweep's only, and writes the sweep's jobs there where they are known in advance
(``SWEEP/.gradmod/plan.json``). A record still ``running`` after the sweep ended is a job
whose process died without a word (the launcher's worker killed): it is reported as
``killed``; a record that cannot be read (cut short) as ``unreadable``; a planned job
without a record, once the sweep ended (a signal stopped it), as ``not_run``.
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
PLAN = Path(".gradmod") / "plan.json"
NOT_RUN = "not_run"
NUMBERS = (
    "test_accuracy",
    "test_loss",
    "test_metric",
    "tasks",
    "train_loss",
    "seconds",
    "steps",
    "skipped_steps",
    "nonfinite_steps",
    "epochs",
    "signal",
    "privacy",
)  # tasks: {name: {test_loss, test_metric}} of a multi-task run


def jobs_dir(sweep_dir: str | Path) -> Path:
    return Path(sweep_dir) / JOBS


def clear(sweep_dir: str | Path) -> None:
    """Forget an earlier sweep's records (a multirun into the same folder starts)."""
    shutil.rmtree(jobs_dir(sweep_dir), ignore_errors=True)
    (Path(sweep_dir) / PLAN).unlink(missing_ok=True)


def plan(sweep_dir: str | Path, jobs: list[list[str]]) -> None:
    """Record the overrides of every job the sweep will run, in job order."""
    _write(Path(sweep_dir) / PLAN, {"jobs": jobs})


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
    record = {
        "num": num,
        "job": rel,
        "dir": str(job),
        "overrides": list(overrides),
        "status": "running",
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": time.time(),
    }
    _write(jobs_dir(sweep_dir) / f"{num}.json", record)
    return record


def finish(
    sweep_dir: str | Path, record: dict[str, Any], status: str, summary: Mapping[str, Any] | None, error: str = ""
) -> dict[str, Any]:
    """Record how the job ended: ``status``, its error and the summary's numbers."""
    summary = summary or {}
    record = {
        **record,
        "status": status,
        "error": error or summary.get("error") or "",
        "ended": time.time(),
        **{k: summary[k] for k in NUMBERS if k in summary},
    }
    _write(jobs_dir(sweep_dir) / f"{record['num']}.json", record)
    return record


def read(sweep_dir: str | Path, *, ended: bool) -> list[dict[str, Any]] | None:
    """This sweep's job records in job order; None when the sweep folder has none (a sweep
    from before the records, or a folder put together by hand). ``ended``: the sweep is
    over, so a job still ``running`` was killed."""
    folder = jobs_dir(sweep_dir)
    if not folder.is_dir():
        return None
    records = [_read_record(path) for path in folder.glob("*.json")]
    if ended:
        records += _not_run(sweep_dir, {r.get("num") for r in records})
    for r in records:
        if r.get("status") == "running" and (ended or not _alive(r)):
            r["status"] = "killed"
            r["error"] = "the job's process ended without a word (killed by a signal, e.g. the OOM killer's SIGKILL)"
    return sorted(records, key=lambda r: r.get("num", 0) if isinstance(r.get("num", 0), int) else 1 << 62)


def _read_record(path: Path) -> dict[str, Any]:
    """A job's record; one that cannot be read (a job killed as it wrote it) as ``unreadable``."""
    try:
        record = json.loads(path.read_text())
        if isinstance(record, dict):
            return record
        problem = f"holds a JSON {type(record).__name__}, not a record"
    except (OSError, ValueError) as e:
        problem = f"cannot be read ({type(e).__name__}: {' '.join(str(e).split())})"
    num = int(path.stem) if path.stem.isdigit() else 1 << 62  # not a job number: last
    return {
        "num": num,
        "job": path.stem,
        "overrides": [],
        "status": "unreadable",
        "error": f"the job's record {path} {problem}",
    }


def _not_run(sweep_dir: str | Path, recorded: set) -> list[dict[str, Any]]:
    """The planned jobs that have no record: the sweep stopped before they started."""
    try:
        jobs = json.loads((Path(sweep_dir) / PLAN).read_text())["jobs"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    return [
        {
            "num": i,
            "job": str(i),
            "overrides": list(o),
            "status": NOT_RUN,
            "error": "the sweep was stopped before this job started",
        }
        for i, o in enumerate(jobs)
        if i not in recorded
    ]


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
