"""Resume checks what changed; every ending writes summary.json; interrupted runs resume
exactly (the soak test)."""

from __future__ import annotations

import errno
import json
import logging
import os
import random
import signal

import pytest
import torch
from helpers import RESUMABLE, run_train, same_params

from gradmod.app.cli import asked_keys, run
from gradmod.run.folder import checkpoint_file as ckpt
from gradmod.run.resume import apply_optimizer, compare


@pytest.mark.parametrize(
    "change, named",
    [
        (["seed=3"], ["seed: 1234 -> 3"]),
        (["data.batch_size=20"], ["data.batch_size: 10 -> 20"]),
        (["model=resnet18"], ["model.name"]),
        (["hooks.clip.transforms.0.max=0.5"], ["hooks.clip.transforms"]),
        (["seed=3", "data.train_size=40"], ["seed: 1234 -> 3", "data.train_size: 60 -> 40"]),
    ],
)
def test_resume_refuses_what_must_match_naming_each(tmp_path, compose_cfg, change, named):
    run(compose_cfg(*RESUMABLE), tmp_path)
    before = (tmp_path / "summary.json").read_bytes()
    with pytest.raises(ValueError, match="must match") as info:
        run(compose_cfg(*RESUMABLE, "trainer.resume=auto", *change), tmp_path)
    for text in named:
        assert text in str(info.value)
    assert (tmp_path / "summary.json").read_bytes() == before


def test_resume_accept_lets_a_named_difference_through(tmp_path, compose_cfg):
    run(compose_cfg(*RESUMABLE, "trainer.epochs=1"), tmp_path)
    summary = run(compose_cfg(*RESUMABLE, "trainer.resume=auto", "seed=3", "trainer.resume_accept=[seed]"), tmp_path)
    assert summary["status"] == "ok" and summary["epochs"] == 2


def test_resume_applies_a_new_lr_to_the_optimizer_and_logs_it(tmp_path, compose_cfg, caplog):
    run(compose_cfg(*RESUMABLE, "trainer.epochs=1"), tmp_path)
    with caplog.at_level(logging.INFO, logger="gradmod.run.resume"):
        run(compose_cfg(*RESUMABLE, "trainer.resume=auto", "optimizer.lr=0.5", "trainer.log_every=3"), tmp_path)
    assert "optimizer.lr 0.001 -> 0.5" in caplog.text and "trainer.log_every 50 -> 3" in caplog.text
    state = ckpt.latest(tmp_path / "checkpoints")[1]
    assert [g["lr"] for g in state["trainer"]["optimizer"]["param_groups"]] == [0.5]


def test_a_default_that_moved_is_a_warning_naming_it_and_an_asked_change_is_not(caplog):
    saved = {"optimizer": {"lr": 0.001, "betas": [0.9, 0.999]}, "trainer": {"log_every": 50, "resume": None}}
    new = {
        "optimizer": {"lr": 0.0003, "betas": [0.8, 0.9]},
        "trainer": {"log_every": 3, "resume": "auto", "host_heap": "keep"},
    }
    asked = asked_keys(["trainer.log_every=3", "+trainer.resume=auto", "optimizer.betas=[0.8,0.9]"])
    assert asked == ["trainer.log_every", "trainer.resume", "optimizer.betas"]
    with caplog.at_level(logging.INFO, logger="gradmod.run.resume"):
        diffs = compare(saved, new, asked=asked)
    assert diffs["optimizer.lr"] == (0.001, 0.0003)  # applied all the same
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warned == [
        "resume: the default optimizer.lr moved since the checkpoint: 0.001 -> 0.0003, and this command line does "
        "not set it; the run continues with the new value (give optimizer.lr=0.001 to keep the checkpoint's)"
    ]  # betas and log_every were asked for; resume is the resume's own; host_heap is a key the checkpoint lacks
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="gradmod.run.resume"):
        compare(saved, new, asked=asked_keys(["optimizer=adam"]) + asked)  # a group: every key below it
        compare(saved, new)  # a config built in Python: what it holds is what it asked
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_resume_on_the_command_line_warns_of_a_default_that_moved(tmp_path, compose_cfg):
    """A checkpoint whose run had another default lr (as a run of an earlier release would):
    ``train.py trainer.resume=auto`` continues at today's default and says so in a WARNING."""
    run(compose_cfg(*RESUMABLE, "trainer.epochs=1", f"data_dir={tmp_path / 'data'}"), tmp_path)
    path, state = ckpt.latest(tmp_path / "checkpoints")
    state["config"]["optimizer"]["lr"] = 0.002
    ckpt.save(tmp_path / "checkpoints", state, keep=2, run=ckpt.run_of(path))
    proc = run_train(tmp_path, *RESUMABLE, "trainer.resume=auto")
    assert (
        "[WARNING] - resume: the default optimizer.lr moved since the checkpoint: 0.002 -> 0.001, and this "
        "command line does not set it;" in proc.stdout
    ), proc.stdout[-3000:]
    assert proc.stdout.count("[WARNING] - resume:") == 1


def test_apply_optimizer_writes_every_group():
    w = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))]
    opt = torch.optim.Adam([{"params": [w[0]]}, {"params": [w[1]]}], lr=0.1, betas=(0.9, 0.99))
    diffs = compare({"optimizer": {"lr": 0.1, "betas": [0.9, 0.99]}}, {"optimizer": {"lr": 0.2, "betas": [0.8, 0.9]}})
    apply_optimizer(opt, diffs)
    assert [(g["lr"], g["betas"]) for g in opt.param_groups] == [(0.2, (0.8, 0.9))] * 2


def test_a_key_added_since_the_checkpoint_and_left_unset_matches():
    saved = {"optimizer": {"lr": 0.1, "groups": None}}  # a checkpoint written before optimizer.layer_decay
    assert compare(saved, {"optimizer": {"lr": 0.1, "groups": None, "layer_decay": None}}) == {}
    with pytest.raises(ValueError, match=r"optimizer\.layer_decay: '<unset>' -> 0\.75"):
        compare(saved, {"optimizer": {"lr": 0.1, "groups": None, "layer_decay": 0.75}})


def test_disk_full_while_checkpointing_is_a_failed_summary_naming_the_path(tmp_path, compose_cfg, monkeypatch):
    calls, fsync = [0], ckpt.os.fsync

    def full_on_the_second(fd):
        if os.readlink(f"/proc/self/fd/{fd}").endswith(f".pt.{os.getpid()}.tmp"):  # a checkpoint's data
            calls[0] += 1
            if calls[0] == 2:
                raise OSError(errno.ENOSPC, "No space left on device")
        fsync(fd)

    monkeypatch.setattr(ckpt.os, "fsync", full_on_the_second)
    with pytest.raises(OSError) as info:
        run(compose_cfg(*RESUMABLE), tmp_path)
    path = tmp_path / "checkpoints" / "step-000000006.pt"
    assert info.value.filename == str(path) and info.value.errno == errno.ENOSPC
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "failed" and str(path) in summary["error"] and "No space left" in summary["error"]
    assert [p.name for p in ckpt.checkpoints(tmp_path / "checkpoints")] == ["step-000000004.pt"]
    ckpt.load(tmp_path / "checkpoints" / "step-000000004.pt")  # the previous one is intact
    assert not list((tmp_path / "checkpoints").glob(".*.tmp"))


def test_an_unusable_checkpoint_folder_is_one_line_and_a_failed_summary(tmp_path):
    (tmp_path / "checkpoints").write_text("in the way")  # as root, chmod cannot stand in for this
    proc = run_train(tmp_path, *RESUMABLE, check=False)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and str(tmp_path / "checkpoints") in lines[0], proc.stderr
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "failed"


def test_sizes_that_train_but_surprise_warn(tmp_path, compose_cfg, caplog):
    over = [*RESUMABLE, "trainer.epochs=1", "data.batch_size=100", "trainer.accumulate=3"]
    with caplog.at_level(logging.WARNING, logger="gradmod.run.runner"):
        run(compose_cfg(*over), tmp_path)
    assert "data.batch_size=100 is larger than the training set (60 images)" in caplog.text
    assert "trainer.accumulate=3 is more than the 1 batches of an epoch" in caplog.text


@pytest.mark.parametrize("name, code", [("TERM", 143), ("INT", 130)])
def test_a_signal_finishes_the_step_checkpoints_and_exits_with_one_line(tmp_path, compose_cfg, reference, name, code):
    proc = run_train(tmp_path, *RESUMABLE, check=False, env={"GRADMOD_KILL_AT": "step:7", "GRADMOD_KILL_SIGNAL": name})
    assert proc.returncode == code, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"interrupted by SIG{name} after step 8; checkpoint "
        f"{tmp_path / 'checkpoints' / 'step-000000008.pt'}; "
        f"continue with trainer.resume=auto hydra.run.dir={tmp_path}"
    ]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["signal"] == f"SIG{name}" and summary["steps"] == 8
    resumed = run(compose_cfg(*RESUMABLE, "trainer.resume=auto"), tmp_path)
    assert resumed["status"] == "ok" and resumed["resumed_from"].endswith("step-000000008.pt")
    same_params(torch.load(tmp_path / "model.pt"), reference[0])


def _soak(tmp_path, compose_cfg, reference, runs: int, seed: int) -> None:
    rng = random.Random(seed)
    for i in range(runs):
        out = tmp_path / f"run{i}"
        step, name = rng.randint(1, 11), rng.choice(["KILL", "TERM", "INT"])
        proc = run_train(
            out, *RESUMABLE, check=False, env={"GRADMOD_KILL_AT": f"step:{step}", "GRADMOD_KILL_SIGNAL": name}
        )
        expected = -9 if name == "KILL" else 128 + signal.Signals["SIG" + name]
        assert proc.returncode == expected, (i, step, name, proc.stderr)
        summary = run(compose_cfg(*RESUMABLE, "trainer.resume=auto"), out)
        assert summary["status"] == "ok" and summary["steps"] == 12, (i, step, name)
        same_params(torch.load(out / "model.pt"), reference[0])
        assert json.loads((out / "summary.json").read_text())["status"] == "ok"
        assert [json.loads(ln)["epoch"] for ln in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]
        run_id = json.loads((out / ".gradmod" / "run.json").read_text())["run_id"]
        for path in ckpt.checkpoints(out / "checkpoints"):
            assert ckpt.run_of(path) == run_id
            ckpt.load(path)


@pytest.mark.slow  # the sealed-folder tests resume and refuse in the default suite
def test_soak_short(tmp_path, compose_cfg, reference):
    _soak(tmp_path, compose_cfg, reference, runs=3, seed=0)


@pytest.mark.slow
def test_soak_twenty_interrupted_and_resumed_runs(tmp_path, compose_cfg, reference):
    _soak(tmp_path, compose_cfg, reference, runs=20, seed=1)
