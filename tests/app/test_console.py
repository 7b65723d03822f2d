"""One line per epoch on the console, a terminal or a redirected file alike."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from helpers import ROOT, TINY_FAKE

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


# -- the learning rates of every group, progress lines in a long epoch, torch.compile's lines ---


def test_the_line_shows_every_distinct_learning_rate_of_the_groups():
    assert "lr 0.02/0.0003 (4.1 s)" in epoch_line(RECORD, 10, [0.02, 0.0003, 0.02])
    assert "lr 0.001 (4.1 s)" in epoch_line(RECORD, 10, [0.001, 0.001])  # one rate: as the record holds it


def _fit(optimizer_of, caplog, epochs: int = 2, compiled: bool = False) -> list[str]:
    """A small classifier trained by the Trainer with the console's EpochLine; what it logged."""
    import torch

    from gradmod.data import Data
    from gradmod.training.callbacks import EpochLine
    from gradmod.training.schedule import SchedulerCallback
    from gradmod.training.trainer import Trainer, TrainerSettings

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    x, y = torch.randn(40, 6), torch.randint(0, 3, (40,))
    settings = TrainerSettings(batch_size=10, eval_batch_size=40)
    trainer = Trainer(
        model, optimizer_of(model), settings, callbacks=[SchedulerCallback(None), EpochLine(epochs, compiled)]
    )
    with caplog.at_level("INFO", logger="gradmod.training.callbacks"):
        trainer.fit(Data("random", x, y, x, y), epochs)
    return [r.getMessage() for r in caplog.records]


def test_every_learning_rate_under_one_optimizer_and_under_several(caplog):
    import torch

    from gradmod.optim.combined import CombinedOptimizer

    def groups(model):  # one optimizer, two groups
        return torch.optim.SGD(
            [{"params": model[0].parameters(), "lr": 0.02}, {"params": model[2].parameters()}], lr=3e-4
        )

    def combined(model):  # as optimizer=muon builds it: AdamW first, then another optimizer
        return CombinedOptimizer(
            [torch.optim.AdamW(model[2].parameters(), lr=3e-4), torch.optim.SGD(model[0].parameters(), lr=0.02)]
        )

    said = _fit(groups, caplog)
    assert [re.search(r" lr \S+", s).group() for s in said if s.startswith("epoch 2/2: train_loss")] == [
        " lr 0.02/0.0003"
    ]
    caplog.clear()
    said = _fit(combined, caplog)
    assert [re.search(r" lr \S+", s).group() for s in said if s.startswith("epoch 2/2: train_loss")] == [
        " lr 0.0003/0.02"
    ]


def test_a_long_epoch_logs_progress_with_what_is_left(caplog, monkeypatch):
    import torch

    from gradmod.reporting import progress

    monkeypatch.setattr(progress, "EVERY", 0.0)  # a line at every step
    said = _fit(lambda m: torch.optim.SGD(m.parameters(), lr=0.1), caplog)
    lines = [s for s in said if "batches" in s]
    assert [s.split(",")[0] for s in lines] == [
        f"epoch {e}/2: {k}/4 batches ({p}%)" for e in (1, 2) for k, p in ((1, 25), (2, 50), (3, 75))
    ]
    assert "about" not in lines[0] and re.search(r", \d+ s so far, about \d+ s left$", lines[1])


def test_progress_estimates_from_the_rate_after_the_first_unit():
    from gradmod.reporting.progress import Progress, duration

    now = [0.0]
    p = Progress(10, "batches", every=30, clock=lambda: now[0])
    now[0] = 200.0  # the first batch compiles
    assert p.update(1) == "1/10 batches (10%), 3 min 20 s so far"
    now[0] = 210.0
    assert p.update(2) is None  # too soon after the last line
    now[0] = 240.0  # then 10 s a batch
    assert p.update(5) == "5/10 batches (50%), 4 min 0 s so far, about 50 s left"
    assert (duration(7), duration(3725)) == ("7 s", "1 h 2 min")


def test_a_compiled_run_says_it_compiles_and_how_long_it_took(caplog):
    import torch

    said = _fit(lambda m: torch.optim.SGD(m.parameters(), lr=0.1), caplog, epochs=1, compiled=True)
    told = [s for s in said if s.startswith("torch.compile")]
    assert len(told) == 3, said
    assert told[0].startswith("torch.compile (trainer.compile=true): compiling the model as its first step runs")
    assert re.fullmatch(r"torch\.compile: the first step took \d+ s, compilation included", told[1])
    assert re.fullmatch(r"torch\.compile: the first evaluation took \d+ s, compilation included", told[2])
    assert said.index(told[0]) < said.index(told[1]) < [i for i, s in enumerate(said) if "train_loss" in s][0]


def test_a_redirected_run_logs_progress_and_each_groups_rate_to_train_log(tmp_path):
    """``optimizer=muon`` (AdamW 3e-4 and Muon 0.02): train.log and the console get the progress
    lines (the interval set to 0 here) and each group's rate by name on each epoch's line."""
    argv = [str(ROOT / "train.py"), *TINY_FAKE, "optimizer=muon", f"hydra.run.dir={tmp_path / 'run'}"]
    code = (
        "import runpy, sys; import gradmod.reporting.progress as p; p.EVERY = 0.0; "
        f"sys.argv = {argv!r}; runpy.run_path(sys.argv[0], run_name='__main__')"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = (tmp_path / "run" / "train.log").read_text()
    for text in (log, proc.stdout + proc.stderr):
        assert re.search(r"epoch 1/2: 2/6 batches \(33%\), \d+ s so far, about \d+ s left", text), text
        # each group's rate by name, Muon's adjusted one (conv1's 32 x 9 matrix: 0.02 x sqrt(32 / 9)) too
        assert (
            len(re.findall(r"epoch \d/2: train_loss .* lr adamw=0\.0003 muon=0\.02 muon\.adjusted=0\.03771 \(", text))
            == 2
        ), text
