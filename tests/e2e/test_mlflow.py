"""``logger=mlflow`` against a real MLflow tracking server (started here on 127.0.0.1 with a
SQLite store), read back with ``MlflowClient``: params, metrics at their steps, gradient
statistics, artifacts, the status of each ending, a continued run, a sweep's parent run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
from helpers import RESUMABLE, ROOT, TINY_FAKE, compose_config, free_port

mlflow = pytest.importorskip("mlflow", reason="the mlflow extra: pip install 'gradmod[mlflow]'")
from mlflow.tracking import MlflowClient  # noqa: E402

from gradmod.app.config_store import validate  # noqa: E402
from gradmod.run import runner  # noqa: E402

pytestmark = pytest.mark.slow  # a tracking server and several runs


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    home = tmp_path_factory.mktemp("mlflow_server")
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port)]
        + ["--backend-store-uri", f"sqlite:///{home / 'store.db'}", "--artifacts-destination", str(home / "art")]
        + ["--workers", "1"],
        cwd=home,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=os.setpgrp,  # its own process group: the server and its workers stop together
    )
    uri = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(f"{uri}/health", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"mlflow server did not start (exit {proc.poll()})")
            time.sleep(0.5)
    yield uri
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:  # its workers may linger: the whole group, at once
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def _train(out, uri, *overrides):
    cfg = compose_config(*overrides, "logger=mlflow", f"logger.tracking_uri={uri}", "logger.experiment=tests")
    return runner.execute(lambda: validate(cfg), out)


def _run_of(out, client):
    record = json.loads((out / ".gradmod" / "mlflow.json").read_text())
    return client.get_run(record["run_id"])


def test_a_run_and_its_continuation_are_one_mlflow_run(tmp_path, server):
    client = MlflowClient(server)
    first = _train(tmp_path, server, *RESUMABLE, "trainer.epochs=1")
    assert first.status == "ok", first.summary.get("error")
    run_id = _run_of(tmp_path, client).info.run_id
    second = _train(tmp_path, server, *RESUMABLE, "trainer.epochs=2", "trainer.resume=auto")
    assert second.status == "ok"

    run = _run_of(tmp_path, client)
    assert run.info.run_id == run_id and run.info.status == "FINISHED" and run.data.tags["gradmod_status"] == "ok"
    params = run.data.params
    assert params["trainer.epochs"] == "1" and run.data.tags["resumed.trainer.epochs"] == "2"
    assert params["hooks.clip.transforms.0.max"] == "0.01" and params["data.batch_size"] == "10"
    metrics = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    history = client.get_metric_history(run_id, "test_accuracy")
    assert sorted((m.step, m.value) for m in history) == [(r["step"], r["test_accuracy"]) for r in metrics]
    stats = [json.loads(ln) for ln in (tmp_path / "grad_stats.jsonl").read_text().splitlines()]
    norms = {m.step: m.value for m in client.get_metric_history(run_id, "grad/conv1.weight/norm")}
    assert norms == {s["step"]: pytest.approx(s["stats"]["conv1.weight"]["norm"]) for s in stats}
    artifacts = {a.path for a in client.list_artifacts(run_id)}
    assert {"hook_plan.json", "summary.json", "curves.png", "grad_norms.png"} <= artifacts
    summary = json.loads(open(client.download_artifacts(run_id, "summary.json", str(tmp_path / "dl"))).read())
    assert summary == json.loads((tmp_path / "summary.json").read_text())


@pytest.mark.parametrize("ending", ["diverged", "interrupted", "failed"])
def test_each_ending_is_mirrored(tmp_path, server, monkeypatch, ending):
    from gradmod.training.trainer import Trainer

    extra = []
    if ending == "diverged":
        extra = ["+hooks.boom={params: '*', transforms: [{name: scale, factor: 1e300}]}"]
    else:
        fit = Trainer.fit

        def stopped(self, *args, **kwargs):
            if ending == "interrupted":
                os.kill(os.getpid(), signal.SIGTERM)  # noted, stops at the first step's end
            else:
                raise OSError(28, "No space left on device", str(tmp_path / "metrics.jsonl"))
            return fit(self, *args, **kwargs)

        monkeypatch.setattr(Trainer, "fit", stopped)
    result = _train(tmp_path, server, *TINY_FAKE, *extra)
    assert result.status == ending
    run = _run_of(tmp_path, MlflowClient(server))
    assert run.data.tags["gradmod_status"] == ending
    assert run.info.status == {"diverged": "FAILED", "interrupted": "KILLED", "failed": "FAILED"}[ending]


def test_a_sweep_is_a_parent_run_with_its_jobs_as_children(tmp_path, server):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "-m", f"hydra.sweep.dir={tmp_path}", *TINY_FAKE, "trainer.epochs=1"]
        + ["seed=1,2", "logger=mlflow", f"logger.tracking_uri={server}", "logger.experiment=sweeps"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    client = MlflowClient(server)
    runs = client.search_runs([client.get_experiment_by_name("sweeps").experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id]
    assert sorted(r.data.params["seed"] for r in children) == ["1", "2"]
    assert all(r.info.status == "FINISHED" and r.data.tags["gradmod_status"] == "ok" for r in children)
    assert {"sweep.md", "sweep.csv"} <= {a.path for a in client.list_artifacts(parents[0].info.run_id)}


def test_ranks_under_torchrun_log_one_run(tmp_path, server):
    """2 gloo ranks with logger=mlflow: rank 0's run alone (the others' records are thrown away)."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port", str(free_port())]
    cmd += [str(ROOT / "train.py"), "trainer.strategy=ddp", f"hydra.run.dir={run_dir}", *TINY_FAKE]
    cmd += ["trainer.epochs=1", "logger=mlflow", f"logger.tracking_uri={server}", "logger.experiment=ranks"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    client = MlflowClient(server)
    runs = client.search_runs([client.get_experiment_by_name("ranks").experiment_id])
    assert [r.info.run_id for r in runs] == [_run_of(run_dir, client).info.run_id]
    assert runs[0].data.tags["gradmod_status"] == "ok"
