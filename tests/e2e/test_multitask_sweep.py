"""The sweep report of a multi-task sweep: each task's metric with its spread over seeds."""

from __future__ import annotations

import csv
import json
import statistics
from pathlib import Path

import pytest
from helpers import per_loss_method, run_train
from omegaconf import OmegaConf

from gradmod.reporting import sweep_report as sweep


def _job(root: Path, name: str, overrides: list[str], left: float, right: float) -> None:
    d = root / name
    (d / ".hydra").mkdir(parents=True)
    (d / ".hydra" / "overrides.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(overrides)))
    tasks = {
        "left": {"test_loss": 1 - left, "test_metric": left},
        "right": {"test_loss": 1 - right, "test_metric": right},
    }
    summary = {
        "status": "ok",
        "test_accuracy": (left + right) / 2,
        "test_loss": 2 - left - right,
        "tasks": tasks,
        "seconds": 3.0,
    }
    (d / "summary.json").write_text(json.dumps(summary))
    (d / "metrics.jsonl").write_text(
        json.dumps(
            {"epoch": 1, "test_accuracy": summary["test_accuracy"], "test_loss": summary["test_loss"], "tasks": tasks}
        )
        + "\n"
    )


def test_report_gives_each_task_its_spread(tmp_path):
    runs = {"mtl_sum": [(0.80, 0.70), (0.84, 0.72)], "pcgrad": [(0.82, 0.78), (0.86, 0.74)]}
    for i, (hooks, seeds) in enumerate(runs.items()):
        for s, (left, right) in enumerate(seeds):
            _job(tmp_path, str(2 * i + s), [f"+hooks={hooks}", f"seed={s}"], left, right)
    paths, rows = sweep.write_report(tmp_path)
    table = list(csv.DictReader(open(paths["csv"])))
    assert float(table[1]["left/test_metric"]) == 0.84 and float(table[3]["right/test_loss"]) == pytest.approx(0.26)
    md = paths["md"].read_text()
    assert "## Per task, over seeds" in md and "| group | jobs ok | left | right |" in md
    left = statistics.stdev([0.82, 0.86])
    right = statistics.stdev([0.78, 0.74])
    assert f"| +hooks=pcgrad | 2/2 | 0.8400 ± {left:.4f} | 0.7600 ± {right:.4f} |" in md
    assert f"| +hooks=mtl_sum | 2/2 | 0.8200 ± {statistics.stdev([0.80, 0.84]):.4f} | 0.7100 ± " in md
    groups = sweep.by_group(rows)
    assert [g["group"] for g in groups] == ["+hooks=pcgrad", "+hooks=mtl_sum"]  # the mean over tasks ranks them
    assert groups[0]["accuracy"] == pytest.approx(0.80)


def test_single_task_report_has_no_task_table(tmp_path):
    for s in range(2):
        d = tmp_path / str(s)
        (d / ".hydra").mkdir(parents=True)
        (d / ".hydra" / "overrides.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create([f"seed={s}"])))
        (d / "summary.json").write_text(json.dumps({"status": "ok", "test_accuracy": 0.9, "test_loss": 0.1}))
    paths, _ = sweep.write_report(tmp_path)
    assert "Per task" not in paths["md"].read_text()
    assert list(csv.DictReader(open(paths["csv"])))[0].keys() == set(sweep.COLUMNS)


@pytest.mark.slow
def test_multi_mnist_sweep_over_methods_and_seeds(tmp_path):
    methods = ["none"] + [h for h, t in (("mtl_sum", "sum"), ("pcgrad", "pcgrad")) if per_loss_method(t)]
    run_train(
        tmp_path,
        "data=multi_mnist",
        "model=multi_lenet",
        "data.n_test=200",
        "trainer.epochs=1",
        "trainer.device=cpu",
        "trainer.progress=false",
        "trainer.threads=1",
        f"+hooks={','.join(methods)}",
        "seed=0,1",
        multirun=True,
    )
    rows = list(csv.DictReader(open(tmp_path / "sweep.csv")))
    assert len(rows) == 2 * len(methods) and all(r["status"] == "ok" for r in rows)
    assert all(0.1 < float(r["left/test_metric"]) <= 1 and 0.1 < float(r["right/test_metric"]) <= 1 for r in rows)
    md = (tmp_path / "sweep.md").read_text()
    for hooks in methods:  # one method alone is every job's: the group of all
        group = f"+hooks={hooks}" if len(methods) > 1 else "(all)"
        assert f"| {group} | 2/2 | 0." in md.split("## Per task, over seeds")[1], hooks


def _regression_job(root, name: str, overrides: list[str], status: str, rmse: float | None) -> None:
    d = root / name
    (d / ".hydra").mkdir(parents=True)
    (d / ".hydra" / "overrides.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(overrides)))
    tasks = {"cls": {"test_metric": 0.8, "test_loss": 0.5, "metric": "accuracy"}}
    tasks["reg"] = {"test_metric": rmse, "test_loss": None if rmse is None else rmse**2, "metric": "rmse"}
    summary = {"status": status, "test_accuracy": None, "test_loss": 1.0 if rmse is None else rmse, "tasks": tasks}
    (d / "summary.json").write_text(json.dumps(summary))


def test_groups_rank_by_a_chosen_task_metric_in_its_direction(tmp_path):
    """No job has an accuracy: the groups still count their ok jobs, rank by the task's rmse
    (lower is better) and fill the per-task table."""
    jobs = [("+hooks=a", "ok", 0.30), ("+hooks=a", "ok", 0.34), ("+hooks=b", "ok", 0.10), ("+hooks=b", "failed", None)]
    for i, (hooks, status, rmse) in enumerate(jobs):
        _regression_job(tmp_path, str(i), [hooks, f"seed={i}"], status, rmse)
    paths, rows = sweep.write_report(tmp_path, metric="reg")
    md = paths["md"].read_text()
    assert "4 jobs: 3 ok, 1 failed." in md
    assert "ranked by reg test rmse (lower is better" in md
    assert md.index("| +hooks=b | 1/2 | 0.1000 |") < md.index("| +hooks=a | 2/2 | 0.3200 ± ")
    assert "| group | jobs ok | cls | reg |" in md and "cls: accuracy, reg: rmse" in md
    groups = sweep.by_group(rows, sweep.ranking(rows, "reg", "higher"))
    assert [g["group"] for g in groups] == ["+hooks=a", "+hooks=b"]
    with pytest.raises(ValueError, match=r"report.metric='nope'; allowed: auto, accuracy, loss, cls, reg"):
        sweep.ranking(rows, "nope")
