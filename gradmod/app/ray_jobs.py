"""A sweep on a Ray cluster (``hydra/launcher=ray``, the `ray` extra): each job a Ray task
that reserves ``num_cpus`` cores (its torch threads) on some node, every ending reported.

Built on plain ``ray``, not hydra-ray-launcher: that plugin pins ``cloudpickle<3`` below what
joblib declares, adds about 60 packages (boto3, the autoscaler's), sets
``object_store_memory`` itself, which a running cluster refuses, and lets Ray retry a task
whose worker died, so that the retry of a job whose first attempt had finished is reported
``refused``. Here a task is never retried (``max_retries=0``): a job whose worker died is
settled as submitit's are (``launchers.settle_lost``): ``ok`` where its folder holds the
complete run it started, else ``killed``.
"""

from __future__ import annotations

import logging
import socket
import sys
from pathlib import Path
from typing import Any, Sequence

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, configure_log, filter_overrides, run_job, setup_globals
from omegaconf import OmegaConf, open_dict

from gradmod.app import isolated
from gradmod.app.launchers import lost_return, settle_lost

log = logging.getLogger(__name__)

AUTO = "auto"  # a cluster running on the local host (ray start --head), else a local one for the sweep


def stop(message: str) -> None:
    """Bad input before any job: one line, exit status 2."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        stop("hydra/launcher=ray needs Ray, which the `ray` extra installs: pip install 'gradmod[ray]'")
    return ray


def connect(ray: Any, address: str | None, init: dict[str, Any]) -> bool:
    """Join the cluster at ``address``; ``auto``: a running one, else start one here.
    Returns whether this process started it (and so shuts it down)."""
    if ray.is_initialized():
        return False
    quiet = {"log_to_driver": True, "logging_level": logging.WARNING, **init}
    if not address or address == AUTO:
        try:
            ray.init(address=AUTO, **quiet)
            return False
        except ConnectionError:  # no cluster runs here: one for this sweep
            ray.init(**quiet)
            return True
    try:
        ray.init(address=address, **quiet)
    except Exception as e:
        stop(f"hydra.launcher.address={address}: Ray could not join the cluster there ({_first_line(e)})")
    return False


def _reachable(address: str, timeout: float = 5.0) -> None:
    """An address no cluster answers at is said in one line, in seconds (Ray itself retries
    for minutes)."""
    host_port = address.removeprefix("ray://").rsplit("/", 1)[0]
    host, _, port = host_port.rpartition(":")
    if not host or not port.isdigit():
        stop(
            f"hydra.launcher.address={address}: not an address; give HOST:PORT (the head's, e.g. 10.0.0.5:6379), ray://HOST:10001, or auto"
        )
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            pass
    except OSError as e:
        stop(
            f"hydra.launcher.address={address}: no Ray cluster answers there ({e.strerror or type(e).__name__}); "
            "start one with: ray start --head, or give hydra.launcher.address=auto"
        )


def _first_line(e: BaseException) -> str:
    return " ".join(str(e).strip().split("\n")[0].split())[:300] or type(e).__name__


def _job(hydra_context: Any, config: Any, task_function: Any, singleton_state: Any) -> JobReturn:
    """One job in a Ray worker, as Hydra's basic launcher runs it. The worker's own threads
    (gRPC's) started before gradmod was imported: its training child is a fresh interpreter."""
    isolated.never_fork()
    Singleton.set_state(singleton_state)
    setup_globals()
    return run_job(
        hydra_context=hydra_context,
        task_function=task_function,
        config=config,
        job_dir_key="hydra.sweep.dir",
        job_subdir_key="hydra.sweep.subdir",
    )


class RayJobs:
    """The launcher's body (``hydra_plugins.gradmod_launchers.ray.RayLauncher``)."""

    def __init__(self, **params: Any) -> None:
        self.params = {k: OmegaConf.to_container(v) if OmegaConf.is_config(v) else v for k, v in params.items()}
        self.config: Any = None
        self.hydra_context: Any = None
        self.task_function: Any = None

    def setup(self, *, hydra_context: Any, task_function: Any, config: Any) -> None:
        self.config, self.hydra_context, self.task_function = config, hydra_context, task_function

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        address = self.params.get("address")
        if address and address != AUTO:
            _reachable(address)  # before Ray is imported: the line says what is wrong first
        ray = import_ray()
        started = connect(ray, address, dict(self.params.get("init") or {}))
        try:
            return self._run(ray, job_overrides, initial_job_idx)
        finally:
            if started:
                ray.shutdown()

    def _run(self, ray: Any, job_overrides: Sequence[Sequence[str]], first: int) -> list[JobReturn]:
        setup_globals()
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        cpus = float(self.params.get("num_cpus") or 1)
        task = ray.remote(_job).options(num_cpus=cpus, num_gpus=float(self.params.get("num_gpus") or 0), max_retries=0)
        log.info("Launching %d jobs on Ray (%s CPUs each)", len(job_overrides), cpus)
        refs = []
        for num, overrides in enumerate(job_overrides, start=first):
            log.info(f"\t#{num} : {' '.join(filter_overrides(overrides))}")
            config = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
            with open_dict(config):
                config.hydra.job.id = f"ray_{num}"
                config.hydra.job.num = num
                config.hydra.sweep.dir = str(sweep_dir.resolve())  # a worker's working folder is not ours
            refs.append(task.remote(self.hydra_context, config, self.task_function, Singleton.get_state()))
        returns = []
        for num, overrides, ref in zip(range(first, first + len(refs)), job_overrides, refs):
            try:
                returns.append(ray.get(ref))
            except Exception as e:  # WorkerCrashedError, a node lost: the job's worker died
                status = settle_lost(sweep_dir, num, overrides, "its Ray worker", e)
                log.error("job %s %s: its Ray worker died before the job ended", num, status)
                returns.append(lost_return(overrides, str(sweep_dir / str(num))))
        return returns
