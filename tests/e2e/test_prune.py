"""``experiment=prune`` end to end on the bundled digits: a scoring run, its self-influence, and
the sweep of shares x {random, GraNd, EL2N, self-influence} with its report."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
from helpers import run_train

SAMPLE = ["data=mnist_sample", "trainer.threads=1", "trainer.progress=false"]


@pytest.mark.slow
def test_the_prune_sweep_keeps_each_scores_hardest_and_reports(tmp_path):
    from gradmod.analysis.score_report import score_run

    scoring = tmp_path / "scoring"
    run_train(scoring, *SAMPLE, "+hooks=scores", "trainer.epochs=2", "seed=0")  # the split is seeded
    score_run(scoring, batch_size=200, top=4, device="cpu")
    sweep = tmp_path / "sweep"
    run_train(
        sweep,
        "experiment=prune",
        *SAMPLE,
        f"data.keep.scores={scoring}",
        "trainer.epochs=1",
        "data.keep.fraction=0.1",
        "seed=0",
        multirun=True,
    )
    jobs = {}
    for summary in sweep.glob("*/summary.json"):
        overrides = (summary.parent / ".hydra" / "overrides.yaml").read_text()
        arm = next(a for a in ("random", "grand", "el2n", "self_influence") if f"prune={a}\n" in overrides)
        jobs[arm] = summary.parent
        assert json.loads(summary.read_text())["train_size"] == 400  # a tenth of the 4,000 training digits
    assert sorted(jobs) == ["el2n", "grand", "random", "self_influence"]
    with open(scoring / "self_influence.csv") as f:  # highest first: the top 400 are the ones kept
        top = sorted(int(r["index"]) for r in list(csv.DictReader(f))[:400])
    with open(scoring / "scores.csv") as f:  # the experiment ranks by epoch 2's GraNd and EL2N
        rows = [r for r in csv.DictReader(f) if r["epoch"] == "2"]
    el2n = np.array([float(r["el2n"]) for r in rows])
    hardest_el2n = sorted(int(rows[i]["index"]) for i in np.argsort(-el2n, kind="stable")[:400])
    for arm, expected in (("self_influence", top), ("el2n", hardest_el2n)):
        log = (jobs[arm] / "train.log").read_text()
        assert f"data.keep: 400 of 4000 training examples, the hardest by {arm}" in log
        assert _kept(jobs[arm]) == expected
    report = (sweep / "sweep.md").read_text()
    for arm in jobs:
        assert f"prune={arm}" in report


def _kept(job) -> list[int]:
    """The examples a job trained on, from its config rebuilt (the same code path as the run's)."""
    from gradmod.analysis.self_influence import read_checkpoint, run_data
    from gradmod.run.folder import checkpoint_file as ckpt

    config = read_checkpoint(ckpt.checkpoints(job / "checkpoints")[-1])[1]
    return run_data(config, job).dataset_index().tolist()
