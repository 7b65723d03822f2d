"""The command line: ``gradmod ...`` (or ``python train.py ...``) -> Hydra -> one training run per job;
``gradmod scores RUN`` scores a finished run's training examples (``scores_command``).

``main()`` has Hydra compose the config from the shipped ``gradmod/conf/`` (a user's own
folder joins it through ``--config-dir`` or ``hydra.searchpath``) and run ``job`` on it; ``job``
checks the config (``validate``) and trains (``gradmod.run.runner.execute``, which settles
the run's ending once and returns it as a value). Every ending is one line on stderr and
an exit status (``gradmod.run.folder.endings``): a config error found
while Hydra composes, or bad input found before training, exits 2; a failed file
operation or an error raised in the user's own code 1 (``train.log`` keeps the
traceback); a diverged run 3; a signal 128 + its number. A bug in gradmod keeps its
traceback, as does every error under ``HYDRA_FULL_ERROR=1``.

In a multirun (``-m``) each job trains in a child process of its own (``isolated``), so a
job killed by a signal ends only itself; a job that raises does not end the sweep either: its
folder gets a ``summary.json`` with ``status: failed`` and the error (where the folder is
its own), its log the traceback, and the sweep goes on. Each job records its ending in the
sweep folder (``sweep_jobs``), and the sweep report (``gradmod.app.sweep_callback.SweepReport``)
exits non-zero at the end when any job did not end ok (also where the sweeper stops by
raising, as Optuna does when no trial completed: ``report_cut_short``). Ctrl-C or SIGTERM ends the sweep
(the job in progress ends ``interrupted``) with the report of what ran, naming the jobs
that did not; ``hydra.run.dir=''`` is refused (a run needs a folder of its own).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import logging
import os
import re
import signal
import sys
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException, MissingConfigException, OverrideParseException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict, read_write
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from gradmod.app import config_files, interrupted_at_start
from gradmod.app.config_store import one_line, unknown_key, validate
from gradmod.app.help import register_help
from gradmod.app.hydra_versions import main_options
from gradmod.app.isolated import preload, run_isolated
from gradmod.app.job_files import JobFiles
from gradmod.app.launchers import PLUGIN_EXTRAS, job_threads
from gradmod.app.sweep_callback import report_cut_short, stop_asked, stop_sweep
from gradmod.install import BrokenInstall, gradmod_version
from gradmod.reporting import sweep_jobs
from gradmod.reporting.sweep_report import launcher_threads
from gradmod.training.distributed.ranks import env_rank, follower_overrides

if TYPE_CHECKING:
    from gradmod.run.folder import endings

# Loaded once Hydra has composed the config (torch and the rest of training: seconds), so
# that a config error is reported in a second; a sweep loads it before its jobs fork.
TRAINING = "gradmod.run.runner"

log = logging.getLogger("gradmod")

_USER_FULL_ERROR = os.environ.get("HYDRA_FULL_ERROR") == "1"  # read before main sets it for Hydra
# The shipped configs (package data); resolved, as a strict editable install links each file.
CONF = Path(__file__).resolve().parents[1] / "conf"


def main(conf: str | Path = CONF) -> None:
    """Compose the config in ``conf`` from the command line and run ``job``; end in one line.
    The console script ``gradmod`` and ``python train.py`` both call it with the default."""
    signal.signal(signal.SIGINT, interrupted_at_start)  # until the run or the sweep installs its own
    if sys.argv[1:2] == ["scores"]:  # gradmod scores RUN: an analysis of a finished run, no Hydra
        from gradmod.app.scores_command import main as scores

        sys.exit(scores(sys.argv[2:]))
    if sys.argv[1:2] == ["influence"]:  # gradmod influence RUN: the same, test examples' proponents and opponents
        from gradmod.app.influence_command import main as influence

        sys.exit(influence(sys.argv[2:]))
    if "--version" in sys.argv[1:]:  # gradmod's, not Hydra's (which would answer it)
        print(f"gradmod {gradmod_version()} (Python {sys.version.split()[0]})")
        sys.exit(0)
    register_help(conf, page=bool({"--help", "-h"} & set(sys.argv[1:])), argv=sys.argv[1:])  # gradmod --help
    sys.argv += follower_overrides(sys.argv)  # torchrun ranks > 0 leave the run folder to rank 0
    try:
        config_files.check(sys.argv[1:], shipped=conf)  # the user's YAML, before Hydra would hang or trace on it
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra raises instead of printing its own lines
    try:
        hydra.main(config_path=str(Path(conf).resolve()), config_name="config", **main_options())(job)()
    except Exception as e:  # job ends its own errors (it exits); these are Hydra's and OmegaConf's
        jobs = report_cut_short()  # a sweep the sweeper ended by raising: what ran, reported
        code = _config_status(e)
        if _USER_FULL_ERROR or code is None or e is _RAISED[0]:
            raise
        stopped = "" if jobs is None else f"the sweeper stopped ({describe(e)})" + (f" after {jobs}" if jobs else "")
        print(f"error: {stopped or describe(e)}", file=sys.stderr)
        sys.exit(code if jobs is None else 1)
    finally:
        if not _USER_FULL_ERROR:
            os.environ.pop("HYDRA_FULL_ERROR", None)


_RAISED: list[BaseException | None] = [None]  # the error job raised itself (a bug): main keeps its traceback


def run(cfg: DictConfig, out: str | Path) -> dict[str, Any]:
    """Python's way in: check a composed config (``hydra.compose``) and train into ``out``;
    returns the summary. Errors are raised as they are (``job`` turns them into endings)."""
    from gradmod.run import runner

    return runner.train(validate(cfg), out)


def job(cfg: DictConfig) -> float | None:
    """One Hydra job: check the config and train into Hydra's output folder. Returns the test
    accuracy (what a sweeper such as Optuna optimizes); None for a failed job of a sweep."""
    hydra_cfg = HydraConfig.get()
    out = hydra_cfg.runtime.output_dir
    if hydra_cfg.mode != RunMode.MULTIRUN:
        _refuse_no_folder(hydra_cfg.run.dir)
        return _conclude(_train(cfg, out, multirun=False))["test_accuracy"]
    if not cfg.trainer.threads:
        # Jobs side by side (joblib, submitit_local) share the cores; a SLURM job has its cpus_per_task.
        threads = launcher_threads(hydra_cfg.launcher) or job_threads()
        if threads:
            cfg.trainer.threads = threads
    return _sweep_job(cfg, hydra_cfg, out)["test_accuracy"]


def _refuse_no_folder(run_dir: Any) -> None:
    """``hydra.run.dir=''`` would train into the current folder, among whatever it holds."""
    if not str(run_dir or "").strip():
        print(
            "error: hydra.run.dir is empty; a run needs a folder of its own: give hydra.run.dir=PATH, or leave "
            "it out for a new folder under outputs/",
            file=sys.stderr,
        )
        sys.exit(2)


def _sweep_job(cfg: DictConfig, hydra_cfg: Any, out_dir: str) -> dict[str, Any]:
    """One job of a multirun, trained in a child process (``isolated``) so that a job killed
    by a signal ends only itself; its ending is recorded for the report (``sweep_jobs``)."""
    sweep_dir = hydra_cfg.sweep.dir
    if stop_asked():  # a signal between two jobs: this one does not start
        stop_sweep(sweep_dir, stop_asked())
    before = _run_marks(out_dir)
    _training(lambda: preload(TRAINING))  # imported once here, inherited by every job's child
    record = sweep_jobs.start(sweep_dir, hydra_cfg.job.num, out_dir, list(hydra_cfg.overrides.task))
    code, summary = run_isolated(_in_child, (cfg, out_dir, _plain_plugins(HydraConfig.instance().cfg)))
    status, error = _ending(code, summary, before, _run_marks(out_dir))
    sweep_jobs.finish(sweep_dir, record, status, summary, error)
    if status != "ok":
        log.error("job %s %s: %s", hydra_cfg.job.num, status, error)
    if status == "interrupted" or stop_asked():  # Ctrl-C or SIGTERM ends the sweep, as a run, with its report
        stop_sweep(sweep_dir, stop_asked() or (code - 128 if code > 0 else -code))
    return {**(summary or {"test_accuracy": None, "test_loss": None}), "status": status, "error": error}


def _plain_plugins(hydra_cfg: DictConfig) -> DictConfig:
    """The Hydra state with its launcher and sweeper nodes as plain mappings: a plugin's
    config class may not pickle by name into a fresh interpreter, and the job reads neither."""
    plain = hydra_cfg.copy()
    with read_write(plain.hydra), open_dict(plain.hydra):
        for key in ("launcher", "sweeper"):
            plain.hydra[key] = OmegaConf.create(OmegaConf.to_container(hydra_cfg.hydra[key], resolve=False))
    return plain


def _in_child(cfg: DictConfig, out_dir: str, hydra_cfg: DictConfig) -> tuple[int, dict[str, Any] | None]:
    """The job in its child process. A fresh interpreter (``isolated``) first takes on the
    launcher's Hydra state and job logging, which a forked child inherits."""
    from gradmod.training.interrupt import Interrupted

    if not HydraConfig.initialized():
        from hydra.core.utils import configure_log

        HydraConfig.instance().set_config(hydra_cfg)
        configure_log(hydra_cfg.hydra.job_logging, hydra_cfg.hydra.verbose)
    ending = _train(cfg, out_dir, multirun=True)
    if isinstance(ending.error, Interrupted):
        _say(ending.error)
        return ending.error.exit_code, ending.summary
    return 0, ending.summary  # a failed job: recorded, and the sweep goes on


def _run_marks(out_dir: str) -> tuple[bytes | None, ...]:
    """What an owning run rewrites in its folder: its summary and its run record."""
    return tuple(_read_bytes(Path(out_dir) / name) for name in ("summary.json", ".gradmod/run.json"))


def _ending(code: int, summary: dict[str, Any] | None, before: tuple, after: tuple) -> tuple[str, str]:
    """(status, error) of a sweep job from how its child ended. A job that did not end ok and
    left an earlier run's summary and run record as they were was refused: the folder is
    that run's, and the job wrote nothing of its own."""
    if code in (-signal.SIGINT, -signal.SIGTERM, -signal.SIGHUP):  # before the run could catch it
        return "interrupted", f"interrupted by {signal.Signals(-code).name} before training started"
    if code < 0:
        name = signal.Signals(-code).name
        return "killed", f"killed by {name}" + (" (the OOM killer sends SIGKILL)" if name == "SIGKILL" else "")
    if summary is None:
        return "failed", f"the job's process exited with status {code} without a summary"
    status, error = str(summary.get("status", "failed")), str(summary.get("error") or "")
    earlier = [b is not None and b == a for b, a in zip(before, after)]
    if status not in ("ok", "refused") and any(earlier):
        status = "refused"
    return status, error


def _read_bytes(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


def _train(cfg: DictConfig, out: str, multirun: bool) -> endings.Ending:
    """Train into ``out``; returns how the run ended. The job's ``.hydra/`` and ``train.log`` go
    into ``out`` once the run owns it (``JobFiles``), or at its ending where the folder is
    free; an error's line (and, unless it is bad input or a signal, its traceback) goes into
    the log. A failed job of a sweep keeps its traceback in its train.log, and the sweep's
    console gets its one line (``_sweep_job``); the sweep goes on."""
    runner = _training(lambda: importlib.import_module(TRAINING))  # torch: after Hydra composed the config
    from gradmod.run.folder.claim import may_write
    from gradmod.training.interrupt import Interrupted

    hydra_cfg = HydraConfig.get()
    with JobFiles(hydra_cfg, cfg) as files:
        ending = runner.execute(lambda: validate(cfg), out, files.write, asked_keys(list(hydra_cfg.overrides.task)))
        e = ending.error
        if e is None:
            return ending
        if not isinstance(e, (Exception, Interrupted)):
            raise e  # SystemExit, KeyboardInterrupt: as they came
        if env_rank() == 0 and may_write(out):  # a free folder keeps the job's config and log with its ending
            with contextlib.suppress(OSError):
                files.write(out)
        _to_log_files(e, sweep_job=multirun)
        return ending


def asked_keys(overrides: list[str]) -> list[str] | None:
    """The config keys the command line's ``overrides`` set: ``optimizer.lr=0.1`` sets
    ``optimizer.lr``, a group (``optimizer=sgd``, ``+hooks=clip``) everything below it. A resume
    says a difference outside them as a default that moved (``gradmod.run.resume``). None
    where they do not parse (every difference then counts as asked)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException:
        return None
    return [(o.package or o.key_or_group).replace("/", ".") for o in parsed]


def _training(load: Callable[[], Any]) -> Any:
    """``load()``, the import of the training code; torch and torchvision that do not work
    together end the job here in one line (exit 1), before Hydra adds lines of its own."""
    try:
        return load()
    except BrokenInstall as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)


def _conclude(ending: endings.Ending) -> dict[str, Any]:
    """A single run's ending: the summary when ok; else its line on stderr and exit status
    (here, not in main: Hydra would add a line of its own to a raised error), or, for a
    bug in gradmod, the error raised with its traceback."""
    if ending.error is None:
        return ending.summary
    code = ending.exit_code
    if code is None or _USER_FULL_ERROR:
        _RAISED[0] = ending.error
        raise ending.error
    _say(ending.error)
    sys.exit(code)


def _say(e: BaseException) -> None:
    from gradmod.run.folder import endings
    from gradmod.training.interrupt import Interrupted

    print(("" if isinstance(e, Interrupted) else "error: ") + endings.message(e), file=sys.stderr)


def _config_status(e: BaseException) -> int | None:
    """Exit status for an error Hydra raised while composing or starting the job."""
    if isinstance(e, BrokenInstall):  # torch and torchvision that do not load together
        return 1
    if isinstance(e, (HydraException, OmegaConfBaseException)):  # Hydra's missing option is an OSError too
        return 2
    if isinstance(e, OSError) or isinstance(e.__cause__, OSError):
        return 1  # the run folder or its log file cannot be made
    return 2 if isinstance(e, ValueError) else None


def _to_log_files(e: BaseException, sweep_job: bool) -> None:
    """The ending's line in the run's log files (the terminal gets it once, from ``job``);
    the traceback too, unless the error is a signal or, outside a sweep, bad input, whose
    line says it all (a sweep's console shows a failed job's line only)."""
    from gradmod.run.folder import endings
    from gradmod.training.interrupt import Interrupted

    status = endings.exit_status(e)
    text = endings.message(e) if status is not None else f"{type(e).__name__}: {e}"
    if (status != 2 or sweep_job) and not isinstance(e, Interrupted):
        text += "\n" + _traceback(e)
    record = log.makeRecord(log.name, logging.ERROR, __file__, 0, text, None, None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


def _traceback(e: BaseException) -> str:
    return "".join(traceback.format_exception(type(e), e, e.__traceback__))


def describe(e: BaseException) -> str:
    """One line for a config error from Hydra or OmegaConf."""
    if isinstance(e, BrokenInstall):
        return str(e)
    if _config_status(e) == 1:  # logging's "Unable to configure handler 'file'" hides the path
        from gradmod.run.folder import endings

        return endings.describe_os_error(e if isinstance(e, OSError) else e.__cause__)
    if isinstance(e, MissingConfigException) and e.missing_cfg_file:
        group, _, name = e.missing_cfg_file.rpartition("/")
        if f"{group}/{name}" in PLUGIN_EXTRAS:  # a Hydra plugin's option, its package not installed
            extra = PLUGIN_EXTRAS[f"{group}/{name}"]
            return f"{group}={name} needs the `{extra}` extra: pip install 'gradmod[{extra}]'"
        options = e.options if e.options is not None else _group_options(group, str(e))
        if options is not None:
            return f"{group}={name}: no such option; allowed: {', '.join(options)}"
    if isinstance(e, OverrideParseException):
        return f"cannot parse override {e.override!r}: {str(e).splitlines()[0]}"
    if str(e).startswith("Multiple values for hooks"):
        return _hooks_twice()
    if own := re.search(r"In 'optimizer/([^']+)'.*Key '([^']+)' not in 'OptimizerConfig'", str(e), re.S):
        return _own_optimizer_file(*own.groups())
    cause = e.__cause__ if isinstance(e.__cause__, OmegaConfBaseException) else e
    hint = re.search(r"To append to your config use (\S+)", str(e))  # Hydra's hint, where adding can work
    more = f"; to append to your config use {hint.group(1)}" if hint else ""
    if isinstance(cause, (ConfigKeyError, ConfigAttributeError)) and dataclasses.is_dataclass(cause.object_type):
        return unknown_key(cause.full_key, [f.name for f in dataclasses.fields(cause.object_type)]) + more
    listed = ("is not a ListConfig", "Cannot merge DictConfig with ListConfig")  # one value, or a mapping
    if isinstance(cause, OmegaConfBaseException) and any(m in str(cause) for m in listed) and cause.full_key:
        return _not_a_list(cause.full_key)
    if isinstance(cause, OmegaConfBaseException):
        return one_line(cause) + more
    lines = [
        ln.strip()
        for ln in str(e).splitlines()
        if ln.strip() and not ln.strip().startswith(("full_key:", "object_type=", "reference_type="))
    ]
    return "; ".join(lines)


def _own_optimizer_file(name: str, key: str) -> str:
    """An ``optimizer/NAME.yaml`` of one's own with a key the base schema lacks (Adam's ``betas``)."""
    return (
        f"optimizer/{name}: {key!r} is not a key every optimizer takes; begin the file with "
        f"'defaults: [/schema/optimizer/adam@_here_, _self_]' (or adamw, sgd, muon) for that optimizer's keys, "
        f"or give it as args.{key}"
    )


def _not_a_list(key: str) -> str:
    """``plugins=my_pkg.x``, ``optimizer.groups={params: x}``: a list key given one value or
    one mapping; show it as a list."""
    given = [a.split("=", 1)[1] for a in sys.argv[1:] if a.lstrip("+~").split("=", 1)[0] == key and "=" in a]
    value = given[-1] if given else "a.b"
    return f"{key}={value}: {key} is a list; write {key}=[{value}]"


def _hooks_twice() -> str:
    """``+hooks=clip +hooks=zero``: Hydra takes one value per group; hook configs combine in a list."""
    names = [n for a in sys.argv[1:] if a.startswith("+hooks=") for n in a[7:].strip("[]").split(",") if n]
    return (
        f"+hooks is given {sum(a.startswith('+hooks=') for a in sys.argv[1:])} times; hook configs combine "
        f"in one list: +hooks=[{','.join(names) or 'clip,log'}]"
    )


def _group_options(group: str, message: str) -> list[str] | None:
    """The options of a config group, from the main config folder Hydra's message names."""
    m = re.search(r"provider=main, path=file://(\S+)", message)
    folder = Path(m.group(1)) / group if m else None
    return sorted(p.stem for p in folder.glob("*.yaml")) if folder and folder.is_dir() else None
