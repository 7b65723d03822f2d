"""Hydra launchers whose every job's ending is the truth, where the launcher's own process
for a job can die: submitit's (``hydra/launcher=submitit_local``, ``slurm``) and Ray's
(``hydra/launcher=ray``, ``ray_launcher``).

A job records its own ending in the sweep folder (``sweep_jobs``). When the process that
runs it for the launcher (submitit's job process, a Ray worker) dies, the launcher gets an
exception instead of the job's return; here it becomes that job's ending (``settle_lost``):
the ending the job recorded, if it did; ``ok`` with its numbers where its folder holds the
complete run this job started; else ``killed``, naming the process. The sweep goes on, and
its report says which jobs did not end ok, in one line. The job's training, a child of the
dead process, ends with it (``isolated``): nothing trains on unreported.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from omegaconf import OmegaConf

from gradmod.reporting import sweep_jobs
from gradmod.training.distributed.ranks import node_cores

log = logging.getLogger(__name__)

PLUGINS = "hydra_plugins.gradmod_launchers"  # where Hydra accepts a launcher's class
# The options that Hydra plugins from gradmod's extras add (missing: named with their extra).
PLUGIN_EXTRAS = {
    "hydra/launcher/joblib": "sweeps",
    "hydra/launcher/submitit_local": "sweeps",
    "hydra/launcher/submitit_slurm": "sweeps",
    "hydra/sweeper/optuna": "sweeps",
}
JOB_THREADS = "GRADMOD_JOB_THREADS"  # the launcher's share of the cores for each job it starts at once


def share(jobs: int, cores: int | None = None) -> int:
    """Threads for each of ``jobs`` running at once on the local host's cores (at least 1)."""
    return max(1, (node_cores() if cores is None else cores) // max(1, jobs))


def job_threads(environ: Mapping[str, str] | None = None) -> int:
    """A sweep job's threads as its launcher's environment gives them: submitit_local's
    share (``JOB_THREADS``), a SLURM job's cores (``cpus_per_task``); 0 where none."""
    env = os.environ if environ is None else environ
    for key in (JOB_THREADS, "SLURM_CPUS_PER_TASK"):
        if env.get(key, "").isdigit() and int(env[key]) > 0:
            return min(int(env[key]), node_cores())
    return 0


def settle_lost(sweep_dir: str | Path, num: int, overrides: Sequence[str], who: str, error: BaseException) -> str:
    """Job ``num``'s ending after ``who`` (the launcher's process for it) ended without its
    return; recorded, and returned as its status."""
    path = sweep_jobs.jobs_dir(sweep_dir) / f"{num}.json"
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        record = None
    if record is not None and record.get("status") != "running":
        return str(record["status"])  # the job ended and said so before its process went
    if record is None:  # killed before the job's function ran: it never recorded a start
        record = sweep_jobs.start(sweep_dir, num, Path(sweep_dir) / str(num), list(overrides))
        record["started"] = None
    summary = _complete_run(Path(record["dir"]), record)
    if summary is not None:
        sweep_jobs.finish(sweep_dir, record, "ok", summary)
        return "ok"
    why = f"{who} died before the job ended (killed by a signal, or the machine lost); its training ended with it"
    log.info("job %s: %s: %s", num, who, " ".join(f"{type(error).__name__}: {error}".split())[:2000])
    sweep_jobs.finish(sweep_dir, record, "killed", None, why)
    return "killed"


def _complete_run(folder: Path, record: dict[str, Any]) -> dict[str, Any] | None:
    """The summary of a run that ended ok in ``folder``, written after this job started."""
    summary = folder / "summary.json"
    if record.get("started") is None or not sweep_jobs.written_by(summary, record):
        return None
    try:
        found = json.loads(summary.read_text())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) and found.get("status") == "ok" else None


def lost_return(overrides: Sequence[str], working_dir: str) -> JobReturn:
    """What the sweeper gets for a lost job: no value (Optuna counts the trial failed)."""
    ret = JobReturn(overrides=list(overrides), working_dir=working_dir, status=JobStatus.COMPLETED)
    ret.return_value = None
    return ret


class SubmititEndings:
    """submitit's launch (hydra-submitit-launcher's, the `sweeps` extra), waiting for every
    job and settling the ones whose process died; mixed into its launchers in
    ``hydra_plugins.gradmod_launchers.submitit``."""

    _EXECUTOR: str
    params: dict[str, Any]
    config: Any

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        import submitit
        from hydra.core.singleton import Singleton
        from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf

        params = dict(self.params)
        init = {"folder": params.pop("submitit_folder")}
        if "max_num_timeout" in params:
            init[f"{self._EXECUTOR}_max_num_timeout"] = params.pop("max_num_timeout")
        executor = submitit.AutoExecutor(cluster=self._EXECUTOR, **init)
        base = set(OmegaConf.structured(BaseQueueConf).keys())
        executor.update_parameters(**{k if k in base else f"{self._EXECUTOR}_{k}": v for k, v in params.items()})
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        log.info(f"Submitit '{self._EXECUTOR}' sweep output dir : {sweep_dir}")
        nums = [initial_job_idx + i for i in range(len(job_overrides))]
        for num, overrides in zip(nums, job_overrides):
            log.info(f"\t#{num} : {' '.join(filter_overrides(overrides))}")
        args = [
            (list(o), "hydra.sweep.dir", n, f"job_id_for_{n}", Singleton.get_state())
            for n, o in zip(nums, job_overrides)
        ]
        saved = os.environ.get(JOB_THREADS)
        if self._EXECUTOR == "local":  # every job of the batch at once on the local host: a share each
            os.environ[JOB_THREADS] = str(share(len(job_overrides)))
        try:
            jobs = executor.map_array(self, *zip(*args))
        finally:
            os.environ.pop(JOB_THREADS, None) if saved is None else os.environ.update({JOB_THREADS: saved})
        returns = []
        for num, overrides, job in zip(nums, job_overrides, jobs):
            try:
                returns.append(job.results()[0])
            except Exception as e:  # UncompletedJobError: submitit's process for the job died
                status = settle_lost(sweep_dir, num, overrides, f"submitit job {job.job_id}", e)
                log.error("job %s %s: its submitit process (job %s) ended without a result", num, status, job.job_id)
                returns.append(lost_return(overrides, str(sweep_dir / str(num))))
        return returns


RAY = {  # hydra/launcher=ray (the `ray` extra); docs/guide/sweeps.md
    "_target_": f"{PLUGINS}.ray.RayLauncher",
    "address": "auto",  # auto: the cluster running here (ray start --head), else one started for the sweep; or HOST:PORT
    "num_cpus": 1,  # cores each job reserves on its node: its torch threads
    "num_gpus": 0,  # GPUs each job reserves
    "init": {},  # more ray.init() arguments, e.g. {runtime_env: {working_dir: .}}
}


def register() -> None:
    """``hydra/launcher=ray``, and gradmod's launchers in place of submitit's under
    submitit's own names. Hydra's plugin scan runs each plugin's config module and stores
    its nodes, on the first use of ``Plugins``: it runs here first (a fraction of a second,
    no heavy import), so that these nodes, stored after, are the ones composed."""
    from hydra.core.config_store import ConfigStore
    from hydra.core.plugins import Plugins

    Plugins.instance()
    cs = ConfigStore.instance()
    # Hydra 1.4 asks a store over another's node to say so (1.3 replaces without the word).
    replace = {"replace": True} if "replace" in inspect.signature(cs.store).parameters else {}
    cs.store(group="hydra/launcher", name="ray", node=RAY, provider="gradmod", **replace)
    try:
        from hydra_plugins.hydra_submitit_launcher.config import LocalQueueConf, SlurmQueueConf
    except ImportError:  # the `sweeps` extra not installed: Hydra names the launcher missing
        return
    for name, node in (("submitit_local", LocalQueueConf), ("submitit_slurm", SlurmQueueConf)):
        target = f"{PLUGINS}.submitit.{'SubmititLocal' if name.endswith('local') else 'SubmititSlurm'}"
        cs.store(group="hydra/launcher", name=name, node=node(_target_=target), provider="gradmod", **replace)
