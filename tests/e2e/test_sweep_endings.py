"""A sweep reports what its own jobs did: killed and refused jobs by name, nothing read from
an earlier sweep's files, a non-zero exit when any job did not end ok; and the report per
group of seeds (accuracy and loss mean ± std, clipping statistics, the no-rules baseline)."""

from __future__ import annotations

import csv
import json
import statistics
from pathlib import Path

import pytest
from helpers import SWEEP_JOB, run_train
from omegaconf import OmegaConf

from gradmod.reporting import sweep_report as sweep

TINY = [*SWEEP_JOB, "trainer.epochs=2", "trainer.threads=1"]
DIES = ["model._target_=tests.support.sweep_models.tiny"]  # +model.die=true: SIGKILL while the model is built


def rows(sweep_dir: Path) -> list[dict[str, str]]:
    with open(sweep_dir / "sweep.csv", newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow  # several processes, each a run
def test_killed_job_is_named_and_a_rerun_reports_refused_not_stale_results(tmp_path):
    first = run_train(tmp_path, *TINY, *DIES, "+model.die=true,false", multirun=True, check=False)
    assert first.returncode == 1, first.stderr
    assert "job 0 killed: killed by SIGKILL" in first.stderr
    assert [r["status"] for r in rows(tmp_path)] == ["killed", "ok"]  # the sibling and the report survive
    finished = (tmp_path / "1" / "summary.json").read_bytes()
    assert json.loads(finished)["status"] == "ok"

    again = run_train(tmp_path, *TINY, *DIES, "+model.die=true,false", multirun=True, check=False)
    assert again.returncode == 1, again.stderr
    table = rows(tmp_path)
    assert [r["status"] for r in table] == ["killed", "refused"]
    assert "holds an earlier run's results" in table[1]["error"]
    assert table[1]["test_accuracy"] == ""  # not the earlier sweep's number
    assert (tmp_path / "1" / "summary.json").read_bytes() == finished  # the refused job wrote nothing
    assert "2 jobs: 0 ok, 1 killed, 1 refused." in (tmp_path / "sweep.md").read_text()


@pytest.mark.slow
def test_sigkilled_job_under_joblib_leaves_its_siblings_and_the_report(tmp_path):
    proc = run_train(
        tmp_path,
        *TINY,
        *DIES,
        "+model.die=true,false,false",
        "hydra/launcher=joblib",
        "hydra.launcher.n_jobs=2",
        multirun=True,
        check=False,
    )
    assert proc.returncode == 1, proc.stderr
    assert "TerminatedWorkerError" not in proc.stderr and "Traceback" not in proc.stderr
    assert [r["status"] for r in rows(tmp_path)] == ["killed", "ok", "ok"]
    for job in ("1", "2"):
        assert json.loads((tmp_path / job / "summary.json").read_text())["status"] == "ok"


@pytest.mark.slow
def test_a_sigkilled_optuna_trial_ends_only_itself(tmp_path):
    """The Optuna sweeper holds its study in its own process, which has thread pools of its
    own (numpy's), so a trial cannot be forked from it: it runs in a fresh interpreter."""
    marker = tmp_path / "first-trial-dies"
    dies_once = ["model._target_=tests.support.sweep_models.dies_once", f"+model.marker={marker}"]
    sweep = tmp_path / "sweep"
    proc = run_train(
        sweep, *TINY, *dies_once, "experiment=clip_optuna", "hydra.sweeper.n_trials=3", multirun=True, check=False
    )
    assert proc.returncode == 1, proc.stderr
    assert [r["status"] for r in rows(sweep)] == ["killed", "ok", "ok"]  # the study went on
    assert "3 jobs: 2 ok, 1 killed." in (sweep / "sweep.md").read_text()
    best = OmegaConf.load(sweep / "optimization_results.yaml").best_value
    assert best == max(float(r["test_accuracy"]) for r in rows(sweep)[1:])
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "job 0 killed: killed by SIGKILL" in errors[0]


@pytest.mark.slow
def test_an_optuna_study_whose_every_trial_is_killed_still_writes_its_report(tmp_path):
    proc = run_train(
        tmp_path,
        *TINY,
        *DIES,
        "+model.die=true",
        "experiment=clip_optuna",
        "hydra.sweeper.n_trials=2",
        multirun=True,
        check=False,
    )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert [r["status"] for r in rows(tmp_path)] == ["killed", "killed"]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        "error: the sweeper stopped (No trials are completed yet.) after 2 of 2 jobs did not end ok: job 0 killed: "
        "killed by SIGKILL (the OOM killer sends SIGKILL); job 1 killed: killed by SIGKILL (the OOM killer sends "
        f"SIGKILL) (see {tmp_path / 'sweep.md'})"
    ]


@pytest.mark.slow
def test_report_per_group_against_the_jobs_own_files(tmp_path):
    proc = run_train(tmp_path, *TINY, "+hooks=none,norm", "seed=0,1", multirun=True)
    assert proc.returncode == 0
    table = {(r["overrides"].split()[-2], r["overrides"].split()[-1]): r for r in rows(tmp_path)}
    md = (tmp_path / "sweep.md").read_text()
    for hooks in ("+hooks=none", "+hooks=norm"):
        jobs = sorted(tmp_path.glob("[0-9]*"))
        summaries = [
            json.loads((j / "summary.json").read_text())
            for j in jobs
            if hooks in (j / ".hydra" / "overrides.yaml").read_text()
        ]
        acc = [s["test_accuracy"] for s in summaries]
        loss = [s["test_loss"] for s in summaries]
        expected = (
            f"| {hooks} | 2/2 | {statistics.fmean(acc):.4f} ± {statistics.stdev(acc):.4f} | "
            f"{statistics.fmean(loss):.4f} ± {statistics.stdev(loss):.4f} |"
        )
        assert expected in md
    for seed in ("seed=0", "seed=1"):
        assert table[("+hooks=none", seed)]["clip_coef"] == ""  # no rules: nothing clipped
        norm = table[("+hooks=norm", seed)]
        # global_norm_clip(max_norm=1): coefficient min(1, 1 / total norm), at every read.
        job = next(d for d in tmp_path.glob("[0-9]*") if norm["job"] == d.name)
        reads = [
            json.loads(ln)["stats"]["norm/global_norm_clip"]
            for ln in (job / "grad_stats.jsonl").read_text().splitlines()
        ]
        assert float(norm["total_norm"]) == pytest.approx(statistics.fmean(r["norm"] for r in reads), rel=1e-4)
        assert 0 < float(norm["clip_coef"]) <= 1 and float(norm["skipped_steps"]) == 0
    assert (tmp_path / "sweep_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _row(group: str, acc: float, status: str = "ok") -> dict:
    return {
        "overrides": [group],
        "status": status,
        "test_accuracy": acc,
        "test_loss": 1 - acc,
        "clip_coef": None,
        "frac_clipped": None,
        "total_norm": None,
        "skipped_steps": 0,
        "seconds": 1.0,
    }


def test_spread_note_names_groups_within_the_seed_spread():
    close = [_row("+hooks=a", 0.90), _row("+hooks=a", 0.94), _row("+hooks=b", 0.90), _row("+hooks=b", 0.92)]
    note = sweep.spread_note(sweep.by_group(close))
    assert note.startswith("Within the seed spread of the best group (`+hooks=a`): `+hooks=b`")
    apart = [
        _row("+hooks=a", 0.90),
        _row("+hooks=a", 0.91),
        _row("+hooks=b", 0.50),
        _row("+hooks=b", 0.51),
        _row("+hooks=b", 0.0, status="failed"),
    ]
    groups = sweep.by_group(apart)
    assert [(g["group"], g["ok"], g["jobs"]) for g in groups] == [("+hooks=a", 2, 2), ("+hooks=b", 2, 3)]
    assert groups[1]["accuracy"] == pytest.approx(0.505)  # the failed job does not count
    assert "ahead of every other by more than the seed spread" in sweep.spread_note(groups)
    one_seed = sweep.by_group([_row("+hooks=a", 0.9), _row("+hooks=b", 0.8)])
    assert sweep.spread_note(one_seed).startswith("One seed per group")


def test_clip_stats_are_means_over_the_jobs_reads(tmp_path):
    reads = [
        {
            "norm/global_norm_clip": {"norm": 2.0, "clip_coef": 0.5, "frac_clipped": 1.0, "calls": 4},
            "conv1.weight/pre": {"norm": 9.0},
        },
        {"norm/global_norm_clip": {"norm": 0.5, "clip_coef": 1.0, "frac_clipped": 0.0, "calls": 4}},
    ]
    lines = [json.dumps({"epoch": 1, "step": 4 * (i + 1), "stats": s}) for i, s in enumerate(reads)]
    (tmp_path / "grad_stats.jsonl").write_text("\n".join(lines) + '\n{"epoch": 2, "st')  # last line cut short
    assert sweep.clip_stats(tmp_path) == {"clip_coef": 0.75, "frac_clipped": 0.5, "total_norm": 1.25}
    per_tensor = {"a/post": {"frac_clipped": 0.2}, "b/post": {"frac_clipped": 0.4}, "a/pre": {"norm": 1.0}}
    (tmp_path / "grad_stats.jsonl").write_text(json.dumps({"epoch": 1, "step": 1, "stats": per_tensor}) + "\n")
    assert sweep.clip_stats(tmp_path) == {"clip_coef": None, "frac_clipped": pytest.approx(0.3), "total_norm": None}
