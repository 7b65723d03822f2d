"""The command-line job behind ``train.py``: one Hydra job -> one training run.

Bad input, whether Hydra finds it while composing (an unknown option or key, a wrong
type) or ``gradmod`` finds it before training (a ``ValueError``), is one line on stderr
and exit status 2; a run stopped by non-finite gradients (``trainer.nonfinite=raise``) is
one line and exit status 3. ``HYDRA_FULL_ERROR=1`` shows the traceback instead.

In a multirun (``-m``) a job that raises must not end the sweep: its folder gets a
``summary.json`` with ``status: failed`` and the error, its log the traceback, and the
sweep goes on; the sweep report (``gradmod.app.sweep_callback.SweepReport``) exits non-zero at the end.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Callable

from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException, MissingConfigException, OverrideParseException
from hydra.types import RunMode
from omegaconf import DictConfig
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from gradmod.app.config_store import one_line, unknown_key, validate
from gradmod.reporting.sweep_report import failed_summary, format_exception, launcher_threads
from gradmod.run import folder as run_folder
from gradmod.run import runner
from gradmod.run.runner import describe_os_error
from gradmod.training.interrupt import Interrupted
from gradmod.training.nonfinite import NonFiniteError

log = logging.getLogger("gradmod")

_USER_FULL_ERROR = os.environ.get("HYDRA_FULL_ERROR") == "1"

def run(cfg: DictConfig, out_dir: str | Path) -> dict[str, Any]:
    """Check a composed config, then train as it says into ``out_dir``; returns the summary."""
    return runner.run(validate(cfg), out_dir)


def job(cfg: DictConfig) -> dict[str, Any]:
    hydra_cfg = HydraConfig.get()
    out_dir = hydra_cfg.runtime.output_dir
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    if multirun and not cfg.trainer.threads:
        # Jobs running side by side (joblib) share the cores: cores // n_jobs threads each.
        threads = launcher_threads(hydra_cfg.launcher)
        if threads:
            cfg.trainer.threads = threads
    start = time.perf_counter()
    try:
        return run(cfg, out_dir)
    except Interrupted as e:  # SIGINT/SIGTERM: the run wrote its checkpoint and summary
        log.warning("%s", e)
        print(str(e), file=sys.stderr)
        sys.exit(e.exit_code)
    except Exception as e:
        bad_input = isinstance(e, (ValueError, NonFiniteError, OSError))
        rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0)))
        summary = _failed_ending(out_dir if rank == 0 else None, e, time.perf_counter() - start)
        if not multirun and (not bad_input or _USER_FULL_ERROR):  # cli.main sets HYDRA_FULL_ERROR itself
            raise
        if multirun:
            log.error("job failed, the sweep goes on: %s\n%s", e, format_exception(e))
            return summary
        message = describe_os_error(e) if isinstance(e, OSError) else str(e)
        _to_log_files(logging.ERROR, message)  # train.log keeps it; the terminal gets it once, below
        print(f"error: {message}", file=sys.stderr)
        sys.exit(3 if isinstance(e, NonFiniteError) else 1 if isinstance(e, OSError) else 2)


def _failed_ending(out_dir: str | None, e: BaseException, seconds: float) -> dict[str, Any]:
    """The failed summary: the run's own when it owned its folder; else written only where
    it replaces no earlier run's files (a refused run also puts back that run's .hydra)."""
    if hasattr(e, "gradmod_summary"):
        return e.gradmod_summary
    if out_dir is None:
        return failed_summary(None, e, seconds)
    if not run_folder.may_write(out_dir):
        run_folder.restore_kept(out_dir)
        return failed_summary(None, e, seconds)
    try:
        return failed_summary(out_dir, e, seconds)
    except OSError:  # the folder itself is the problem (a file, read-only): the error says so
        return failed_summary(None, e, seconds)


def _to_log_files(level: int, message: str) -> None:
    """Write a record to the run's log files only (the console gets the one-line error)."""
    record = log.makeRecord(log.name, level, __file__, 0, message, None, None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


def describe(e: BaseException) -> str:
    """One line for a config error from Hydra or OmegaConf."""
    if isinstance(e, MissingConfigException) and e.missing_cfg_file:
        group, _, name = e.missing_cfg_file.rpartition("/")
        options = e.options if e.options is not None else _group_options(group, str(e))
        if options is not None:
            return f"{group}={name}: no such option; allowed: {', '.join(options)}"
    if isinstance(e, OverrideParseException):
        return f"cannot parse override {e.override!r}: {str(e).splitlines()[0]}"
    if str(e).startswith("Multiple values for hooks"):
        return _hooks_twice()
    cause = e.__cause__ if isinstance(e.__cause__, OmegaConfBaseException) else e
    if isinstance(cause, (ConfigKeyError, ConfigAttributeError)) and dataclasses.is_dataclass(cause.object_type):
        return unknown_key(cause.full_key, [f.name for f in dataclasses.fields(cause.object_type)])
    hint = re.search(r"To append to your config use (\S+)", str(e))  # Hydra's hint, where adding can work
    more = f"; to append to your config use {hint.group(1)}" if hint else ""
    if isinstance(cause, OmegaConfBaseException):
        return one_line(cause) + more
    lines = [ln.strip() for ln in str(e).splitlines()
             if ln.strip() and not ln.strip().startswith(("full_key:", "object_type=", "reference_type="))]
    return "; ".join(lines)


def _hooks_twice() -> str:
    """``+hooks=clip +hooks=zero``: Hydra takes one value per group; hook configs combine in a list."""
    names = [n for a in sys.argv[1:] if a.startswith("+hooks=") for n in a[7:].strip("[]").split(",") if n]
    return (f"+hooks is given {sum(a.startswith('+hooks=') for a in sys.argv[1:])} times; hook configs combine "
            f"in one list: +hooks=[{','.join(names) or 'clip,log'}]")


def _group_options(group: str, message: str) -> list[str] | None:
    """The options of a config group, from the main config folder Hydra's message names."""
    m = re.search(r"provider=main, path=file://(\S+)", message)
    folder = Path(m.group(1)) / group if m else None
    return sorted(p.stem for p in folder.glob("*.yaml")) if folder and folder.is_dir() else None


def main(hydra_main: Callable[[], Any]) -> None:
    """Run a ``@hydra.main`` function so that config errors are one line and exit 2.

    Hydra prints composition errors over several lines (some with a traceback) unless
    ``HYDRA_FULL_ERROR=1``; setting it makes Hydra raise, and this reports them instead.
    Other exceptions are bugs and keep their traceback.
    """
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        hydra_main()
    except (HydraException, OmegaConfBaseException, ValueError) as e:
        if _USER_FULL_ERROR:
            raise
        print(f"error: {describe(e)}", file=sys.stderr)
        sys.exit(2)
    except OSError as e:  # Hydra could not make the run folder (a file there, a read-only parent)
        if _USER_FULL_ERROR:
            raise
        print(f"error: {describe_os_error(e)}", file=sys.stderr)
        sys.exit(1)
    finally:
        if not _USER_FULL_ERROR:
            os.environ.pop("HYDRA_FULL_ERROR", None)
