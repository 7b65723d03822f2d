"""One line per epoch on the console, a terminal or a redirected file alike."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from helpers import ROOT

from gradmod.reporting.console import epoch_line

RECORD = {
    "epoch": 3,
    "step": 120,
    "train_loss": 0.41234,
    "test_loss": 0.39811,
    "test_accuracy": 0.88125,
    "test_metric": 0.88125,
    "lr": 0.001,
    "seconds": 4.123,
    "train_seconds": 3.9,
    "eval_seconds": 0.2,
    "skipped_steps": 0,
    "grad_stats": {"clip": {"norm": 1.0}},
}


def test_the_line_holds_the_epochs_numbers_but_its_bookkeeping():
    assert epoch_line(RECORD, 10) == (
        "epoch 3/10: train_loss 0.4123 test_loss 0.3981 test_accuracy 0.8812 lr 0.001 (4.1 s)"
    )


def test_any_metric_and_epsilon_the_record_holds_appear_in_its_order():
    record = {
        "epoch": 1,
        "train_loss": 1.0,
        "test_left_accuracy": 0.5,
        "test_right_accuracy": 0.25,
        "epsilon": 1.2345678,
        "seconds": 1.0,
    }
    assert epoch_line(record) == (
        "epoch 1: train_loss 1 test_left_accuracy 0.5 test_right_accuracy 0.25 epsilon 1.235 (1.0 s)"
    )


def test_skipped_steps_and_non_numbers():
    line = epoch_line(
        {
            "epoch": 2,
            "train_loss": float("nan"),
            "test_accuracy": None,
            "skipped_steps": 3,
            "flag": True,
            "seconds": 2.0,
        },
        2,
    )
    assert line == "epoch 2/2: train_loss nan skipped_steps 3 (2.0 s)"


@pytest.mark.slow
def test_a_redirected_dp_run_shows_a_line_per_epoch_with_epsilon(tmp_path):
    """``python train.py +hooks=dp > log 2>&1``: the file gets each epoch's line as it ends."""
    overrides = [
        "+hooks=dp",
        "data=fake",
        "data.image_size=28",
        "data.channels=1",
        "data.train_size=60",
        "data.test_size=20",
        "data.batch_size=10",
        "trainer.epochs=2",
        "trainer.device=cpu",
        "trainer.threads=1",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]
    log = tmp_path / "log"
    cmd = " ".join([sys.executable, str(ROOT / "train.py"), *[f"'{o}'" for o in overrides], f"> {log} 2>&1"])
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run(cmd, shell=True, cwd=ROOT, env=env, check=True, timeout=600)
    lines = [ln for ln in log.read_text().splitlines() if re.search(r"\bepoch \d/2: ", ln)]
    assert len(lines) == 2, log.read_text()
    for n, line in enumerate(lines, 1):
        assert re.search(
            rf"epoch {n}/2: train_loss \S+ test_loss \S+ test_accuracy \S+ .*epsilon \S+ \(\d+\.\d s\)$", line
        ), line


def test_each_tasks_numbers_by_name_and_the_metric_once():
    record = {
        "epoch": 1,
        "train_loss": 0.5,
        "test_loss": 0.4,
        "test_accuracy": 0.75,
        "test_metric": None,
        "tasks": {
            "left": {"test_loss": 0.3, "test_metric": 0.8, "metric": "accuracy"},
            "right": {"test_loss": 0.5, "test_metric": 0.7, "metric": "rmse"},
            "other": {"test_loss": 0.6, "test_metric": 0.1},
        },
        "seconds": 1.0,
    }
    assert epoch_line(record) == (
        "epoch 1: train_loss 0.5 test_loss 0.4 test_accuracy 0.75 left.test_loss 0.3 left.test_accuracy 0.8 "
        "right.test_loss 0.5 right.test_rmse 0.7 other.test_loss 0.6 other.test_metric 0.1 (1.0 s)"
    )
    single = {"epoch": 1, "test_accuracy": 0.75, "test_metric": 0.75, "seconds": 1.0}
    assert epoch_line(single) == "epoch 1: test_accuracy 0.75 (1.0 s)"
