"""Sweeps on launchers whose own process for a job can die (submitit's, Ray's): the report
against the job folders, one line naming the job that did not end ok, each job's threads
its share of the cores."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import ROOT, SWEEP_JOB

from gradmod.app import launchers
from gradmod.reporting import sweep_jobs

TINY = [*SWEEP_JOB, "trainer.epochs=1", "model._target_=tests.support.sweep_models.waits"]


def rows(sweep_dir: Path) -> list[dict[str, str]]:
    with open(sweep_dir / "sweep.csv", newline="") as f:
        return list(csv.DictReader(f))


RAY_LOCAL = {"RAY_AUTH_MODE": "disabled"}  # a cluster on localhost for this test: no token to hand around


def start_sweep(sweep: Path, *overrides: str) -> subprocess.Popen:
    cmd = [sys.executable, str(ROOT / "train.py"), "-m", f"hydra.sweep.dir={sweep}", *TINY, *overrides]
    env = {**os.environ, "PYTHONPATH": str(ROOT), **RAY_LOCAL}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def kill_when_written(pid_file: Path, proc: subprocess.Popen, timeout: float = 300) -> int:
    """SIGKILL to the process whose pid the waiting job wrote; returns that pid."""
    deadline = time.monotonic() + timeout
    while not pid_file.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.2)
    pid = int(pid_file.read_text())
    os.kill(pid, signal.SIGKILL)
    return pid


def check_against_folders(sweep: Path, killed: str) -> None:
    """The report's rows against the job folders: ok jobs with their own summaries' numbers,
    the killed job with no complete run in its folder."""
    for row in rows(sweep):
        folder = sweep / row["job"]
        if row["job"] == killed:
            assert row["status"] == "killed"
            summary = folder / "summary.json"
            assert not summary.exists() or json.loads(summary.read_text())["status"] != "ok"
        else:
            summary = json.loads((folder / "summary.json").read_text())
            assert row["status"] == summary["status"] == "ok"
            assert float(row["test_accuracy"]) == pytest.approx(summary["test_accuracy"])


def _job_one_killed(proc, pid_file, sweep, exception: str, line: str) -> None:
    """Job 1's process killed once it wrote ``pid_file``: the sweep exits 1 with one ``error:`` line
    (``line`` in it), no traceback nor the launcher's ``exception``, and its folders agree."""
    kill_when_written(pid_file, proc)
    _, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 1, stderr
    assert "Traceback" not in stderr and exception not in stderr
    errors = [ln for ln in stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and line in errors[0], stderr
    check_against_folders(sweep, killed="1")


@pytest.mark.slow  # three jobs at once under submitit's local executor (about 40 s on 2 cores)
def test_submitit_local_job_process_killed_is_named_and_its_siblings_report(tmp_path):
    sweep, pid_file = tmp_path / "sweep", tmp_path / "job.pid"
    proc = start_sweep(
        sweep, "hydra/launcher=submitit_local", f"+model.pid_file={pid_file}", "+model.wait=false,true,false"
    )
    _job_one_killed(proc, pid_file, sweep, "UncompletedJobError", "job 1 killed: submitit job ")
    for job in ("0", "2"):  # three jobs at once on these cores: a share each, not every core
        threads = json.loads((sweep / job / "summary.json").read_text())["threads"]
        assert threads == launchers.share(3)


def test_a_lost_job_is_killed_or_ok_by_what_its_folder_holds(tmp_path):
    sweep = tmp_path
    before_start = launchers.settle_lost(sweep, 0, ["seed=0"], "submitit job 7_0", RuntimeError("gone"))
    record = sweep_jobs.start(sweep, 1, sweep / "1", ["seed=1"])
    (sweep / "1").mkdir()
    (sweep / "1" / "summary.json").write_text(json.dumps({"status": "ok", "test_accuracy": 0.5}))
    finished = launchers.settle_lost(sweep, 1, ["seed=1"], "ray worker", RuntimeError("gone"))
    sweep_jobs.start(sweep, 2, sweep / "2", ["seed=2"])  # started, its folder holds no complete run
    died = launchers.settle_lost(sweep, 2, ["seed=2"], "ray worker", RuntimeError("gone"))
    sweep_jobs.finish(sweep, sweep_jobs.start(sweep, 3, sweep / "3", ["seed=3"]), "failed", None, "ValueError: x")
    said = launchers.settle_lost(sweep, 3, ["seed=3"], "ray worker", RuntimeError("gone"))
    assert (before_start, finished, died, said) == ("killed", "ok", "killed", "failed")
    records = {r["num"]: r for r in sweep_jobs.read(sweep, ended=True)}
    assert records[0]["error"].startswith("submitit job 7_0 died before the job ended")
    assert records[1]["test_accuracy"] == 0.5
    assert record["started"] <= records[1]["ended"]


@pytest.fixture
def ray_cluster():
    """A real local Ray cluster of 2 CPUs (``ray start --head --block``, its own temp folder);
    ended by the id of the process this fixture started."""
    pytest.importorskip("ray")
    import shutil
    import socket
    import tempfile

    from helpers import free_port

    port, temp = free_port(), tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths
    ray = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", f"--port={port}", "--num-cpus=2"]
    ray += [f"--temp-dir={temp}", "--node-ip-address=127.0.0.1", "--include-dashboard=false", "--block"]
    env = {**os.environ, **RAY_LOCAL}
    head = subprocess.Popen(ray, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=os.setsid)
    deadline = time.monotonic() + 120
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert head.poll() is None and time.monotonic() < deadline, "ray start --head did not start"
            time.sleep(0.5)
    yield f"127.0.0.1:{port}"
    os.killpg(head.pid, signal.SIGTERM)  # the group of the head this fixture started
    try:
        head.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(head.pid, signal.SIGKILL)
    shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.ray  # a real Ray cluster (the `ray` extra): about 60 s on 2 cores
def test_ray_worker_killed_mid_job_is_named_and_its_siblings_report(tmp_path, ray_cluster):
    sweep, pid_file = tmp_path / "sweep", tmp_path / "job.pid"
    proc = start_sweep(
        sweep,
        "hydra/launcher=ray",
        f"hydra.launcher.address={ray_cluster}",
        f"+model.pid_file={pid_file}",
        "+model.wait=false,true,false",
    )
    _job_one_killed(proc, pid_file, sweep, "WorkerCrashedError", "job 1 killed: its Ray worker died")
    for job in ("0", "2"):
        assert json.loads((sweep / job / "summary.json").read_text())["threads"] == 1  # num_cpus: 1


def test_an_unreachable_ray_address_is_one_line(tmp_path):
    from helpers import free_port

    address = f"127.0.0.1:{free_port()}"
    proc = start_sweep(tmp_path, "hydra/launcher=ray", f"hydra.launcher.address={address}", "seed=0,1")
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 2 and "Traceback" not in stderr
    assert stderr.strip().splitlines() == [
        f"error: hydra.launcher.address={address}: no Ray cluster answers there (Connection refused); start one "
        "with: ray start --head, or give hydra.launcher.address=auto"
    ]


def test_a_launcher_whose_extra_is_missing_names_the_extra(tmp_path):
    from hydra.errors import MissingConfigException

    from gradmod.app.cli import describe

    missing = MissingConfigException("Could not load 'hydra/launcher/submitit_local'", "hydra/launcher/submitit_local")
    assert describe(missing) == (
        "hydra/launcher=submitit_local needs the `sweeps` extra: pip install 'gradmod[sweeps]'"
    )
    no_ray = tmp_path / "shim" / "ray"  # `import ray` fails, as without the extra
    no_ray.mkdir(parents=True)
    (no_ray / "__init__.py").write_text("raise ImportError('No module named ray')\n")
    cmd = [sys.executable, str(ROOT / "train.py"), "-m", f"hydra.sweep.dir={tmp_path / 'sweep'}", "hydra/launcher=ray"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(no_ray.parent), str(ROOT)])}
    proc = subprocess.run([*cmd, *TINY, "seed=0,1"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: hydra/launcher=ray needs Ray, which the `ray` extra installs: pip install 'gradmod[ray]'"
    )


def test_a_jobs_threads_from_its_launchers_environment():
    from gradmod.training.distributed.ranks import node_cores

    assert launchers.job_threads({"SLURM_CPUS_PER_TASK": "1"}) == 1  # a SLURM job's cpus_per_task
    assert launchers.job_threads({"SLURM_CPUS_PER_TASK": "4096"}) == node_cores()  # capped by what it may use
    assert (
        launchers.job_threads({launchers.JOB_THREADS: "1", "SLURM_CPUS_PER_TASK": "2"}) == 1
    )  # submitit_local's share
    assert launchers.job_threads({}) == 0  # torch's own choice
    assert launchers.share(3, cores=2) == 1 and launchers.share(2, cores=16) == 8
