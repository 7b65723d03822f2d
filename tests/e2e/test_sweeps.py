"""Sweeps through the real entry point (basic and joblib launchers, a failing job in each),
the sweep report, experiment configs, the Optuna example and the SLURM preset."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import FAST, ROOT, SWEEP_JOB, run_train
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from gradmod.app import cli
from gradmod.hooks import attach
from gradmod.models import build_model
from gradmod.reporting import sweep_report as sweep

TINY = [*SWEEP_JOB, "trainer.epochs=2"]
BOUND = "hooks.clip.transforms.0.bound"  # the Optuna example's tuned key: the clip rule's own bound


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def check_failing_sweep(sweep_dir: Path, proc: subprocess.CompletedProcess) -> list[dict[str, str]]:
    """Job 0 (batch size 0) failed, job 1 still ran; the report and exit status say so."""
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "error: 1 of 2 jobs did not end ok: job 0 failed: ValueError: data.batch_size=0 must be >= 1" in proc.stderr
    failed = json.loads((sweep_dir / "0" / "summary.json").read_text())
    assert failed["status"] == "failed" and failed["error"] == "ValueError: data.batch_size=0 must be >= 1"
    assert "Traceback" in (sweep_dir / "0" / "train.log").read_text()  # the traceback is kept for bugs
    ok = json.loads((sweep_dir / "1" / "summary.json").read_text())
    assert ok["status"] == "ok" and ok["epochs"] == 2
    rows = read_csv(sweep_dir / "sweep.csv")
    assert [r["job"] for r in rows] == ["0", "1"]
    assert rows[0]["status"] == "failed" and rows[0]["error"] == failed["error"] and rows[0]["test_accuracy"] == ""
    assert rows[1]["status"] == "ok" and rows[1]["error"] == ""
    assert float(rows[1]["test_accuracy"]) == ok["test_accuracy"]
    assert float(rows[1]["test_loss"]) == ok["test_loss"]
    assert "data.batch_size=32" in rows[1]["overrides"].split()
    md = (sweep_dir / "sweep.md").read_text()
    assert "2 jobs: 1 ok, 1 failed" in md
    assert "| 0 | data.batch_size=0 | failed |" in md
    assert (sweep_dir / "sweep_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return rows


def test_multirun_basic_launcher_survives_a_failing_job(tmp_path):
    proc = run_train(tmp_path, *TINY, "+hooks=clip", "data.batch_size=0,32", multirun=True, check=False)
    check_failing_sweep(tmp_path, proc)


@pytest.mark.slow  # several processes, each a run
def test_multirun_joblib_launcher_survives_a_failing_job(tmp_path):
    proc = run_train(
        tmp_path,
        *TINY,
        "+hooks=zero",
        "data.batch_size=0,32",
        "hydra/launcher=joblib",
        "hydra.launcher.n_jobs=2",
        multirun=True,
        check=False,
    )
    check_failing_sweep(tmp_path, proc)
    import joblib

    ok = json.loads((tmp_path / "1" / "summary.json").read_text())
    assert ok["threads"] == max(1, joblib.cpu_count() // 2)  # cores // jobs: no oversubscription


def test_single_run_failure_is_one_line_exit_2_and_a_failed_summary(tmp_path):
    proc = run_train(tmp_path, *FAST, "data.batch_size=0", check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == "error: data.batch_size=0 must be >= 1"
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "failed"


def test_launcher_threads():
    joblib = {"_target_": "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher"}
    assert sweep.launcher_threads({**joblib, "n_jobs": 2}, cores=8) == 4
    assert sweep.launcher_threads({**joblib, "n_jobs": 3}, cores=8) == 2
    assert sweep.launcher_threads({**joblib, "n_jobs": -1}, cores=8) == 1  # every core busy
    assert sweep.launcher_threads({**joblib, "n_jobs": -7}, cores=8) == 4  # all but 6: 2 jobs
    assert sweep.launcher_threads({**joblib, "n_jobs": 16}, cores=2) == 1
    basic = {"_target_": "hydra._internal.core_plugins.basic_launcher.BasicLauncher"}
    assert sweep.launcher_threads(basic, cores=8) == 0  # one job at a time: torch's default


# --- the report, from a folder written by hand --------------------------------------------


def fake_job(root: Path, name: str, overrides: list[str], summary: dict | None, accuracies: list[float]) -> None:
    d = root / name
    (d / ".hydra").mkdir(parents=True)
    (d / ".hydra" / "overrides.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(overrides)))
    if summary is not None:
        (d / "summary.json").write_text(json.dumps(summary))
    lines = [json.dumps({"epoch": i + 1, "test_accuracy": a}) for i, a in enumerate(accuracies)]
    (d / "metrics.jsonl").write_text("\n".join(lines) + ("\n" if lines else ""))


@pytest.fixture
def hand_sweep(tmp_path):
    root = tmp_path / "sweep"
    ok = lambda acc: {"status": "ok", "test_accuracy": acc, "test_loss": 1 - acc, "seconds": 12.5}  # noqa: E731
    fake_job(root, "0", ["trainer.epochs=2", "+hooks=clip", "seed=0"], ok(0.90), [0.8, 0.9])
    fake_job(root, "1", ["trainer.epochs=2", "+hooks=clip", "seed=1"], ok(0.94), [0.85, 0.94])
    fake_job(
        root,
        "2",
        ["trainer.epochs=2", "+hooks=zero", "seed=0"],
        {"status": "failed", "error": "ValueError: a | b", "test_accuracy": None, "test_loss": None, "seconds": 0.5},
        [],
    )
    fake_job(root, "10", ["trainer.epochs=2", "+hooks=zero", "seed=1"], None, [0.5])  # killed after epoch 1
    (root / "multirun.yaml").write_text("hydra: {}\n")
    return root


def test_report_contents(hand_sweep):
    paths, rows = sweep.write_report(hand_sweep)
    assert [r["job"] for r in rows] == ["0", "1", "2", "10"]  # job order, not string order
    table = read_csv(paths["csv"])
    assert list(table[0]) == list(sweep.COLUMNS)
    assert [r["status"] for r in table] == ["ok", "ok", "failed", "incomplete"]
    assert table[0]["overrides"] == "trainer.epochs=2 +hooks=clip seed=0"
    assert float(table[1]["test_accuracy"]) == 0.94 and float(table[1]["test_loss"]) == pytest.approx(0.06)
    assert table[2]["error"] == "ValueError: a | b"
    assert table[3]["error"].startswith("no summary.json")
    md = paths["md"].read_text()
    assert "4 jobs: 2 ok, 1 failed, 1 incomplete." in md
    assert "Every job: `trainer.epochs=2`" in md
    assert "| 1 | +hooks=clip seed=1 | ok | 0.9400 | 0.0600 |  |  |  |  | 12.5 |  |" in md
    assert "ValueError: a \\| b" in md  # a pipe in an error does not break the table
    # Mean over the two clip seeds: (0.90 + 0.94) / 2, sample std of the two; loss 1 - accuracy.
    assert "| +hooks=clip | 2/2 | 0.9200 ± 0.0283 | 0.0800 ± 0.0283 |" in md
    assert "| +hooks=zero | 0/2 |" in md
    import matplotlib.image

    img = matplotlib.image.imread(paths["png"])
    assert img.ndim == 3 and img.shape[0] > 100


def test_sweep_report_script_rebuilds_the_report(hand_sweep, monkeypatch, capsys):
    import runpy

    script = str(ROOT / "scripts" / "sweep_report.py")

    def report(path):
        monkeypatch.setattr(sys, "argv", [script, str(path)])
        with pytest.raises(SystemExit) as done:
            runpy.run_path(script, run_name="__main__")
        return done.value.code

    assert report(hand_sweep) == 0
    out = capsys.readouterr().out
    assert "| 0 | +hooks=clip seed=0 | ok | 0.9000 |" in out
    assert (hand_sweep / "sweep.csv").exists() and (hand_sweep / "sweep_curves.png").exists()
    assert report(hand_sweep / "nope") == 2
    assert capsys.readouterr().err.startswith("error: sweep folder")


# --- configs -----------------------------------------------------------------------------


def test_experiment_article_mnist(compose_cfg):
    cfg = compose_cfg("experiment=article_mnist")
    assert cfg.model.name == "mnist_cnn" and cfg.data.name == "mnist" and cfg.seed == 1234
    assert cfg.data.batch_size == 100 and cfg.trainer.epochs == 10
    assert cfg.optimizer._target_ == "torch.optim.Adam" and cfg.optimizer.lr == 0.001
    assert cfg.hooks == {}
    assert compose_cfg("experiment=article_mnist", "+hooks=clip").hooks.clip.params == "*"


def test_experiment_article_resnet_clip(compose_cfg):
    cfg = compose_cfg("experiment=article_resnet_clip", "+hooks=log")
    assert cfg.model.name == "resnet50" and cfg.data.name == "fake"
    assert (cfg.data.image_size, cfg.data.channels, cfg.data.num_classes, cfg.data.batch_size) == (224, 3, 1000, 10)
    rules = OmegaConf.to_container(cfg.hooks, resolve=True)
    assert set(rules) == {"clip", "log"}  # +hooks=... still merges
    assert rules["clip"]["transforms"] == [{"name": "clamp", "min": -0.01, "max": 0.01}]
    model = build_model("resnet50", in_channels=3, num_classes=1000, image_size=224)
    with attach(model, rules) as hooks:
        clipped = {t.name for t in hooks.targets if t.rule == "clip"}
    assert clipped == {n for n, _ in model.named_parameters()}
    assert model.fc.out_features == 1000


def test_optuna_example_composes():
    GlobalHydra.instance().clear()
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "gradmod" / "conf"), version_base="1.3"):
        cfg = compose(
            config_name="config",
            overrides=["experiment=clip_optuna", "hooks.clip.transforms.0.bound=0.03"],
            return_hydra_config=True,
        )
    GlobalHydra.instance().clear()
    sweeper = cfg.hydra.sweeper
    assert sweeper._target_ == "hydra_plugins.hydra_optuna_sweeper.optuna_sweeper.OptunaSweeper"
    assert sweeper.direction == "maximize"
    assert set(sweeper.params) == {BOUND, "optimizer.lr"}
    clamp = OmegaConf.to_container(cfg.hooks, resolve=True)["clip"]["transforms"][0]
    assert clamp == {"name": "clamp", "bound": 0.03}  # the rule's own key, one symmetric bound


@pytest.mark.parametrize("fork", [True, False])
def test_slurm_preset_runs_the_local_task_function(tmp_path, monkeypatch, fork):
    """hydra/launcher=slurm composes, hands submitit the SLURM fields, and the job it would
    submit calls train.py's own task function. Only the submission is swapped: submitit's
    DebugExecutor runs the job in this process instead of sbatch. The job's child is forked,
    or (where a thread pool makes a fork unsafe) a fresh interpreter, which the launcher's
    config must reach too."""
    import runpy

    import submitit

    from gradmod.app import isolated

    monkeypatch.setattr(isolated, "fork_is_safe", lambda: fork)

    seen = {}

    class LocalSlurm:
        def __init__(self, cluster, folder, **kwargs):
            seen["cluster"], seen["folder"] = cluster, folder
            self._debug = submitit.DebugExecutor(folder=folder)

        def update_parameters(self, **params):
            seen["params"] = params

        def map_array(self, fn, *args):
            seen["launcher"] = fn
            return self._debug.map_array(fn, *args)

    monkeypatch.setattr(submitit, "AutoExecutor", LocalSlurm)
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "train.py",
            "-m",
            "hydra/launcher=slurm",
            "hydra.launcher.partition=gpu",
            "hydra.launcher.timeout_min=30",
            f"hydra.sweep.dir={tmp_path}",
            *TINY,
            "+hooks=clip",
            "seed=3",
        ],
    )
    try:  # exactly `python train.py -m ...`, in this process
        runpy.run_path(str(ROOT / "train.py"), run_name="__main__")
    finally:
        GlobalHydra.instance().clear()
    assert seen["cluster"] == "slurm"
    params = seen["params"]
    assert params["slurm_partition"] == "gpu" and params["timeout_min"] == 30
    assert params["gpus_per_node"] == 1 and params["tasks_per_node"] == 1
    assert seen["launcher"].task_function is cli.job  # the function local runs call
    summary = json.loads((tmp_path / "0" / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["seed"] == 3
    assert read_csv(tmp_path / "sweep.csv")[0]["status"] == "ok"


# --- slow: the documented 12-job sweep and a short Optuna study ---------------------------------------


@pytest.mark.slow
def test_twelve_job_sweep_of_hook_configs_by_seeds(tmp_path):
    run_train(tmp_path, *TINY, "+hooks=clip,zero,min_zero,log", "seed=0,1,2", multirun=True)
    rows = read_csv(tmp_path / "sweep.csv")
    assert len(rows) == 12 and all(r["status"] == "ok" for r in rows)
    md = (tmp_path / "sweep.md").read_text()
    for hooks in ("clip", "zero", "min_zero", "log"):
        assert f"| +hooks={hooks} | 3/3 |" in md


@pytest.mark.slow
def test_optuna_two_trials(tmp_path):
    run_train(tmp_path, *TINY, "experiment=clip_optuna", "hydra.sweeper.n_trials=2", multirun=True)
    results = OmegaConf.load(tmp_path / "optimization_results.yaml")
    assert set(results.best_params) == {BOUND, "optimizer.lr"}
    rows = read_csv(tmp_path / "sweep.csv")
    assert len(rows) == 2 and all(r["status"] == "ok" for r in rows)
    for job in ("0", "1"):
        overrides = dict(o.split("=", 1) for o in OmegaConf.load(tmp_path / job / ".hydra" / "overrides.yaml"))
        bound = float(overrides[BOUND])
        plan = json.loads((tmp_path / job / "hook_plan.json").read_text())
        assert plan[0]["transforms"] == [f"clamp(bound={bound})"]
        assert 0.001 <= bound <= 0.1
