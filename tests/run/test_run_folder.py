"""A run owns its folder: the lock, refusal of an earlier run's folder, start over, run ids
in checkpoints, and what a refused run leaves behind (nothing)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from helpers import run_train

from gradmod.app.cli import run
from gradmod.run.folder import checkpoint_file as ckpt
from gradmod.run.folder.claim import RunFolder

TINY = [
    "data=fake",
    "data.image_size=28",
    "data.channels=1",
    "data.train_size=60",
    "data.test_size=20",
    "data.batch_size=10",
    "trainer.epochs=1",
    "trainer.device=cpu",
    "trainer.progress=false",
    "trainer.threads=1",
    "trainer.checkpoint_every_steps=2",
    "trainer.checkpoint_keep=2",
]


def _snapshot(out: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(out)): p.read_bytes()
        for p in sorted(out.rglob("*"))
        if p.is_file() and ".gradmod" not in p.parts and p.name != "train.log"
    }


def test_an_earlier_runs_folder_is_refused_and_left_as_it_was(tmp_path, compose_cfg):
    run(compose_cfg(*TINY), tmp_path)
    before = _snapshot(tmp_path)
    with pytest.raises(ValueError, match="earlier run's results.*trainer.resume=auto.*trainer.start_over=true"):
        run(compose_cfg(*TINY, "seed=5"), tmp_path)
    assert _snapshot(tmp_path) == before


def test_start_over_replaces_every_file_of_the_earlier_run(tmp_path, compose_cfg):
    run(compose_cfg(*TINY, "trainer.checkpoint_keep=10"), tmp_path)
    first_id = json.loads((tmp_path / ".gradmod" / "run.json").read_text())["run_id"]
    summary = run(compose_cfg(*TINY, "trainer.epochs=1", "data.batch_size=20", "trainer.start_over=true"), tmp_path)
    run_id = json.loads((tmp_path / ".gradmod" / "run.json").read_text())["run_id"]
    assert run_id != first_id and summary["steps"] == 3
    files = ckpt.checkpoints(tmp_path / "checkpoints")
    assert [ckpt.step_of(p) for p in files] == [2, 3]  # none of the earlier run's six
    assert {ckpt.run_of(p) for p in files} == {run_id}


def test_a_locked_folder_is_refused_naming_the_holders_pid(tmp_path, compose_cfg):
    holder = RunFolder(tmp_path)
    holder.claim(resume=None, start_over=False)
    try:
        with pytest.raises(ValueError, match=f"in use by another run \\(pid {os.getpid()}"):
            run(compose_cfg(*TINY), tmp_path)
    finally:
        holder.release()
    assert not (tmp_path / "summary.json").exists()
    run(compose_cfg(*TINY), tmp_path)  # released: the folder is free again


def test_pruning_and_auto_resume_see_only_this_runs_files_ordered_by_step(tmp_path):
    for step in (75, 80):
        ckpt.save(tmp_path, {"step": step}, keep=2, run="old")
    for step in (4, 8, 12, 999_999_999, 1_000_000_000):  # names of different length: by step, not by name
        ckpt.save(tmp_path, {"step": step}, keep=2, run="new")
    assert [ckpt.step_of(p) for p in ckpt.checkpoints(tmp_path, "new")] == [999_999_999, 1_000_000_000]
    assert [ckpt.step_of(p) for p in ckpt.checkpoints(tmp_path, "old")] == [75, 80]
    assert ckpt.find("auto", tmp_path, "new")[1]["step"] == 1_000_000_000
    assert ckpt.find("auto", tmp_path, "old")[1]["step"] == 80


def test_auto_resume_ignores_another_runs_newer_checkpoint(tmp_path, compose_cfg):
    run(compose_cfg(*TINY), tmp_path)
    foreign = ckpt.load(ckpt.checkpoints(tmp_path / "checkpoints")[-1])
    ckpt.save(tmp_path / "checkpoints", {**foreign, "step": 80}, keep=5, run="someoneelse")
    summary = run(compose_cfg(*TINY, "trainer.resume=auto"), tmp_path)
    assert summary["resumed_from"].endswith("step-000000006.pt")


@pytest.mark.slow  # several processes, each a run
def test_refused_runs_leave_a_finished_folder_intact(tmp_path):
    run_train(tmp_path, *TINY)
    before = _snapshot(tmp_path)
    for bad in (["trainer.resume=auto", "trainer.epochs=-1"], ["trainer.resume=auto", "seed=3"], []):
        proc = run_train(tmp_path, *TINY, *bad, check=False)
        assert proc.returncode == 2, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1 and proc.stderr.startswith("error: "), proc.stderr
        assert _snapshot(tmp_path) == before, bad


def test_a_run_folder_that_is_a_file_is_one_line(tmp_path):
    target = tmp_path / "taken"
    target.write_text("not a folder")
    proc = run_train(target, *TINY, check=False)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and str(target) in lines[0], proc.stderr
    assert target.read_text() == "not a folder"
