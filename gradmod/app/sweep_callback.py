"""The Hydra callback that writes a sweep's report when a multirun ends, or when a signal
stops it (``stop_sweep``: the report of what ran, naming the jobs that did not)."""

from __future__ import annotations

import logging
import signal
import sys
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from gradmod.reporting import sweep_jobs
from gradmod.reporting.sweep_report import write_report

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class SweepReport(Callback):
    """Hydra callback: forget an earlier sweep's job records when a multirun starts and
    record the jobs it will run (where the sweeper's list is known in advance: the basic
    sweeper's); when it ends, write the report from this sweep's records and exit with
    status 1 if any job did not end ``ok`` (failed, refused, killed, ...: each job's ending
    was recorded, not raised). SIGINT or SIGTERM between two jobs is noted (``stop_asked``)
    and stops the sweep, with its report, before the next job; during a job the job gets it,
    ends ``interrupted``, and the sweep stops the same way."""

    def __init__(self) -> None:
        self._handlers: dict[int, Any] = {}

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = config.hydra.sweep.dir
        logger = config.get("logger") or {}
        if logger.get("name") == "mlflow":  # a store the sweep cannot log into: one line, nothing written
            from gradmod.reporting.mlflow_store import check_store

            try:
                check_store(logger.get("tracking_uri"), logger.get("experiment", "gradmod"))
            except ValueError as e:
                print(f"error: {e}", file=sys.stderr)
                raise SystemExit(2) from None
        storage = config.hydra.sweeper.get("storage")
        if storage and str(config.hydra.sweeper.get("_target_", "")).endswith("OptunaSweeper"):
            from gradmod.app.optuna_storage import StorageError, prepare

            try:
                prepare(str(storage))  # before the sweeper opens it (optuna 2.10 under SQLAlchemy 2)
            except StorageError as e:
                print(f"error: {e}", file=sys.stderr)
                raise SystemExit(2) from None
        sweep_jobs.clear(sweep_dir)
        _OPEN[:] = [sweep_dir]
        jobs = planned_jobs(config)
        if jobs is not None:
            sweep_jobs.plan(sweep_dir, jobs)

        _ASKED.clear()
        self._handlers = {s: signal.signal(s, _note) for s in SIGNALS}
        if logger.get("name") == "mlflow":  # the sweep's parent run; each job a child of it
            from gradmod.reporting import mlflow_tracking

            mlflow_tracking.start_sweep(logger.get("tracking_uri"), logger.get("experiment", "gradmod"), sweep_dir)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        _OPEN.clear()
        for s, handler in self._handlers.items():
            signal.signal(s, handler)
        if stop_asked():  # after the last job: the report says all ran
            stop_sweep(config.hydra.sweep.dir, stop_asked())
        report = OmegaConf.select(config, "report") or {}
        rank = {"metric": report.get("metric", "auto"), "direction": report.get("direction", "auto")}
        try:
            paths, rows = write_report(config.hydra.sweep.dir, ended=True, **rank)
        except ValueError as e:  # a task the jobs do not have: said, and the report ranked as by default
            if not str(e).startswith("report."):
                raise
            print(f"error: {e}; the report ranks by report.metric=auto instead", file=sys.stderr)
            paths, rows = write_report(config.hydra.sweep.dir, ended=True)
        _end_parent(paths, [r["status"] for r in rows])
        log.info("sweep report: %s, %s, %s", *paths.values())
        bad = _not_ok(paths, rows)
        if bad:
            print(f"error: {bad}", file=sys.stderr)
            raise SystemExit(1)


def _not_ok(paths: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """The line naming the jobs that did not end ok ("" when every job did)."""
    bad = [r for r in rows if r["status"] != "ok"]
    if not bad:
        return ""
    return (
        f"{len(bad)} of {len(rows)} jobs did not end ok: "
        + "; ".join(f"job {r['job']} {r['status']}: {r['error']}" for r in bad[:3])
        + ("; ..." if len(bad) > 3 else "")
        + f" (see {paths['md']})"
    )


_OPEN: list[str] = []  # the folder of the multirun that started and has not ended


def report_cut_short() -> str | None:
    """After the sweeper ended the multirun by raising (Optuna's "No trials are completed
    yet" when every trial failed or was killed), Hydra does not end it: the report of the
    jobs that ran is written here. Returns the line naming the jobs that did not end ok
    ("" if all did), or None where no multirun was cut short or no job had started."""
    if not _OPEN:
        return None
    sweep_dir = _OPEN.pop()
    try:
        paths, rows = write_report(sweep_dir, ended=True)
    except ValueError:  # no job had started
        return None
    _end_parent(paths, [r["status"] for r in rows] + ["failed"])
    log.info("sweep report: %s, %s, %s", *paths.values())
    return _not_ok(paths, rows)


_ASKED: list[int] = []  # the signal that asked the sweep to stop, noted by the handler


def _note(signum: int, frame: Any) -> None:
    """A handler only notes: raising here could land anywhere (a fork's after-hooks ignore it)."""
    _ASKED[:] = [signum]


def stop_asked() -> int:
    """The signal that asked the sweep to stop between two jobs (0: none)."""
    return _ASKED[0] if _ASKED else 0


def stop_sweep(sweep_dir: str, signum: int) -> None:
    """End the sweep after ``signum``: its report of what ran, the jobs that did not, and
    exit status 128 + the signal's number."""
    name = signal.Signals(signum).name
    try:
        paths, rows = write_report(sweep_dir, ended=True)
    except ValueError as e:  # no job had started, and the sweeper's list is not known
        print(f"sweep stopped by {name}: no report ({e})", file=sys.stderr)
        raise SystemExit(128 + signum) from None
    _end_parent(paths, [r["status"] for r in rows] + ["interrupted"])
    missing = [r for r in rows if r["status"] == sweep_jobs.NOT_RUN]
    ran = len(rows) - len(missing)
    shared = set.intersection(*(set(r["overrides"]) for r in rows))  # the job's own overrides name it
    named = (
        "; not run: "
        + ", ".join(f"job {r['job']} ({' '.join(o for o in r['overrides'] if o not in shared)})" for r in missing[:5])
        + (", ..." if len(missing) > 5 else "")
        if missing
        else ""
    )
    print(
        f"sweep stopped by {name} after {ran} of {len(rows) if missing else f'{ran} or more'} jobs{named}; "
        f"report: {paths['md']}",
        file=sys.stderr,
    )
    raise SystemExit(128 + signum)


def _end_parent(report: dict[str, Any], statuses: list[str]) -> None:
    """The sweep's MLflow parent run (``logger=mlflow``), ended with the report."""
    import os

    from gradmod.reporting import mlflow_tracking

    if os.environ.get(mlflow_tracking.PARENT):
        try:
            mlflow_tracking.end_sweep(report, statuses)
        except Exception as e:  # the tracker's server gone: the report is in the sweep folder
            log.warning("logger=mlflow: could not end the sweep's run (%s: %s)", type(e).__name__, e)


def planned_jobs(config: DictConfig) -> list[list[str]] | None:
    """Every job's overrides in job order, as the basic sweeper expands them (None for
    another sweeper, which decides its jobs as it goes)."""
    sweeper = config.hydra.sweeper
    if not str(sweeper.get("_target_", "")).endswith(".BasicSweeper"):
        return None
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    params = [f"{k}={v}" for k, v in (sweeper.get("params") or {}).items()]
    try:
        overrides = OverridesParser.create().parse_overrides([*params, *config.hydra.overrides.task])
        batches = BasicSweeper.split_arguments(overrides, None)
    except Exception:  # e.g. a glob() sweep, which needs the config loader: the report names no missing job
        return None
    return [list(job) for batch in batches for job in batch]
