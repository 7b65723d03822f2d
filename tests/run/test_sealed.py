"""A finished run is sealed: its files change only when that same run continues and the
continuation has started. Foreign checkpoints, older steps (timelines), resumes that do not
fit, resume=auto with nothing to resume, two runs at once, start_over, and what a resume may
change (docs/reference/robustness.md)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import KEEP, RESUMABLE, ROOT, compose_config

from gradmod.app.cli import run
from gradmod.app.config_store import validate
from gradmod.run.factories import model_optimizer
from gradmod.run.folder import checkpoint_file as ckpt
from gradmod.run.folder import endings
from gradmod.run.folder.claim import RunFolder
from gradmod.run.resume import apply_optimizer, compare


def snapshot(out: Path) -> dict[str, bytes]:
    """Every file of the folder, lock.pid (the last holder's pid) too, but the lock itself
    (never written, its contents empty)."""
    return {
        str(p.relative_to(out)): p.read_bytes()
        for p in sorted(out.rglob("*"))
        if p.is_file() and p.relative_to(out) != Path(".gradmod/lock")
    }


def run_id(out: Path) -> str:
    return json.loads((out / ".gradmod" / "run.json").read_text())["run_id"]


def steps(folder: Path) -> list[int]:
    return [ckpt.step_of(p) for p in ckpt.checkpoints(folder)]


def test_another_runs_checkpoint_is_refused_in_a_finished_folder_and_forks_into_a_new_one(
    mine, finished_runs, tmp_path
):
    theirs = ckpt.checkpoints(finished_runs["other"] / "checkpoints")[2]  # step 8
    before = snapshot(mine)
    with pytest.raises(
        ValueError,
        match=f"belongs to run {run_id(finished_runs['other'])}, but run folder .* belongs to run {run_id(mine)}",
    ):
        run(compose_config(*KEEP, "seed=7", f"trainer.resume={theirs}"), mine)
    assert snapshot(mine) == before

    fork = tmp_path / "fork"
    summary = run(compose_config(*KEEP, "seed=7", f"trainer.resume={theirs}"), fork)
    assert summary["parent"] == {"run": run_id(finished_runs["other"]), "step": 8}
    assert summary["run"] == run_id(fork) != run_id(finished_runs["other"])
    assert {ckpt.run_of(p) for p in ckpt.checkpoints(fork / "checkpoints")} == {run_id(fork)}
    assert json.loads((fork / ".gradmod" / "run.json").read_text())["parent"]["step"] == 8


def test_a_resume_from_an_older_step_starts_a_timeline_that_auto_follows(mine, caplog):
    old12 = (mine / "checkpoints" / "step-000000012.pt").read_bytes()
    four = mine / "checkpoints" / "step-000000004.pt"
    # From step 4, one epoch only (a stand-in for a run killed at its step 6 checkpoint).
    run(compose_config(*KEEP, f"trainer.resume={four}", "trainer.epochs=1"), mine)
    aside = mine / "checkpoints" / "abandoned-1"
    assert steps(aside) == [6, 8, 12] and (aside / "step-000000012.pt").read_bytes() == old12
    assert "moved to" in caplog.text and str(aside) in caplog.text
    assert steps(mine / "checkpoints") == [4, 6]
    summary = run(compose_config(*KEEP, "trainer.resume=auto"), mine)  # the new timeline, not the abandoned one
    assert summary["resumed_from"].endswith("step-000000006.pt") and summary["steps"] == 12
    assert steps(aside) == [6, 8, 12] and steps(mine / "checkpoints") == [4, 6, 8, 12]


def test_pruning_keeps_the_new_timelines_checkpoints(mine):
    eight = mine / "checkpoints" / "step-000000008.pt"
    run(compose_config(*RESUMABLE, "trainer.checkpoint_keep=1", f"trainer.resume={eight}"), mine)
    assert steps(mine / "checkpoints") == [12]
    assert (mine / "checkpoints" / "abandoned-1" / "step-000000012.pt").is_file()


def _older_format(folder: Path) -> None:
    path = ckpt.checkpoints(folder / "checkpoints")[-1]
    state = ckpt.load(path)
    ckpt.save(folder / "checkpoints", {**state, "format": 1, "step": 13}, keep=10, run=ckpt.run_of(path))


@pytest.mark.parametrize(
    "change, match",
    [
        (["optimizer.no_decay=[conv1.bias]"], "optimizer.no_decay"),
        (["scheduler=cosine"], "scheduler"),
        (["+loss.args.label_smoothing=0.1"], "loss.args.label_smoothing"),
        ([_older_format], "written by another gradmod version"),
        (["trainer.epochs=1"], "trainer.epochs=1 is fewer than the 2 epoch"),
        (["trainer.start_over=true"], "cannot be combined with trainer.resume=auto"),
    ],
)
def test_a_resume_that_does_not_fit_leaves_every_file_as_it_was(mine, change, match):
    if callable(change[0]):
        change[0](mine)
        change = []
    before = snapshot(mine)
    with pytest.raises(ValueError, match=match) as e:
        run(compose_config(*KEEP, "trainer.resume=auto", *change), mine)
    assert "\n" not in str(e.value)
    assert snapshot(mine) == before


@pytest.mark.parametrize("holder", ["4242\n", None])
def test_a_refused_run_leaves_the_lock_holders_pid_as_it_found_it(mine, tmp_path, holder):
    """lock.pid names the last holder (another process here); a run refused after taking the
    lock puts it back byte for byte, or leaves none where there was none."""
    pid = mine / ".gradmod" / "lock.pid"
    if holder is None:
        pid.unlink()
    else:
        pid.write_text(holder)
    before = snapshot(mine)
    with pytest.raises(ValueError, match="optimizer.no_decay"):
        run(compose_config(*KEEP, "trainer.resume=auto", "optimizer.no_decay=[conv1.bias]"), mine)
    assert snapshot(mine) == before and pid.exists() == (holder is not None)


def test_a_schedule_cannot_change_under_a_resume(tmp_path):
    """Extending epochs re-runs a schedule planned for fewer (the lr would climb back up);
    another scheduler would load the old one's state; an accepted change that does not load
    is one line. None of them writes."""
    run(compose_config(*RESUMABLE, "scheduler=cosine", "trainer.epochs=1"), tmp_path)
    before = snapshot(tmp_path)
    for change, match in (
        (["scheduler=cosine"], r"trainer.epochs: 1 -> 2.*resume_accept=\[trainer.epochs\]"),
        (["scheduler=step", "trainer.epochs=1"], "scheduler._target_"),
        (
            [
                "scheduler=warmup_cosine",
                "scheduler.warmup_steps=2",
                "trainer.epochs=1",
                "trainer.resume_accept=[scheduler]",
            ],
            "does not fit .*KeyError",
        ),
    ):
        with pytest.raises(ValueError, match=match) as e:
            run(compose_config(*RESUMABLE, "trainer.resume=auto", *change), tmp_path)
        assert "\n" not in str(e.value)
        assert snapshot(tmp_path) == before, change


@pytest.mark.parametrize("damage", ["truncate", "remove"])
def test_auto_without_a_usable_checkpoint_is_refused_and_deletes_nothing(mine, finished_runs, damage):
    for path in ckpt.checkpoints(mine / "checkpoints"):
        if damage == "truncate":
            path.write_bytes(path.read_bytes()[:1000])
        else:
            path.unlink()
    theirs = ckpt.checkpoints(finished_runs["other"] / "checkpoints")[-1]
    shutil.copy(theirs, mine / "checkpoints" / "step-000000099.pt")  # another run's intact checkpoint
    before = snapshot(mine)
    with pytest.raises(ValueError, match="no usable checkpoint.*trainer.start_over=true discards the folder's results"):
        run(compose_config(*KEEP, "trainer.resume=auto"), mine)
    assert snapshot(mine) == before


@pytest.mark.slow
def test_the_loser_of_two_runs_on_one_folder_writes_nothing(mine):
    """A run refused at the lock leaves the owner's .hydra/ and train.log byte-identical."""
    (mine / ".hydra").mkdir()
    (mine / ".hydra" / "config.yaml").write_text("seed: 1234\n")
    (mine / "train.log").write_text("the owner's log\n")
    before = snapshot(mine)
    holder = RunFolder(mine)
    holder.claim(resume="auto", start_over=False)
    try:
        proc = subprocess.run(
            [sys.executable, str(ROOT / "train.py"), f"hydra.run.dir={mine}", *KEEP, "seed=2", "trainer.resume=auto"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
            env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
        )
    finally:
        holder.release()
    assert proc.returncode == 2 and "in use by another run" in proc.stderr, proc.stderr
    assert snapshot(mine) == before


def test_a_failed_start_in_a_new_folder_does_not_block_the_corrected_run(tmp_path):
    endings.settle(tmp_path, ValueError("trainer.epochs=-1 is below its minimum"), 0.1, owned=False)  # the job's
    summary = run(compose_config(*RESUMABLE, "trainer.epochs=1"), tmp_path)
    assert summary["status"] == "ok"


@pytest.mark.slow
def test_start_over_removes_the_earlier_tensorboard_events(tmp_path):
    tiny = [*RESUMABLE, "trainer.epochs=1", "logger=tensorboard", "trainer.checkpoint_every_steps=0"]
    run(compose_config(*tiny), tmp_path)
    first = set((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    time.sleep(1.1)  # event file names carry the second they were made
    run(compose_config(*tiny, "trainer.start_over=true"), tmp_path)
    now = set((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert len(first) == 1 and len(now) == 1 and not first & now


def test_changing_weight_decay_on_resume_leaves_the_no_decay_group_at_zero():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    cfg = validate(compose_config("optimizer.weight_decay=0.1", "optimizer.no_decay=['*.bias']")).optimizer
    optimizer = model_optimizer(cfg, model)
    optimizer.load_state_dict(optimizer.state_dict())  # as a checkpoint restores it
    apply_optimizer(optimizer, {"optimizer.weight_decay": (0.1, 0.2), "optimizer.lr": (1e-3, 5e-4)})
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.2, 0.0]
    assert [g["lr"] for g in optimizer.param_groups] == [5e-4, 5e-4]


def test_rule_order_must_match_on_resume():
    scale = {"params": "*", "transforms": [{"name": "scale", "factor": 2.0}]}
    clamp = {"params": "*", "transforms": [{"name": "clamp", "min": -0.01, "max": 0.01}]}
    saved = {"hooks": {"s": scale, "c": clamp}}
    with pytest.raises(ValueError, match=r"hooks._order_: \['s', 'c'\] -> \['c', 's'\]"):
        compare(saved, {"hooks": {"c": clamp, "s": scale}})
    assert compare(saved, {"hooks": {"s": scale, "c": clamp}}) == {}
    compare(saved, {"hooks": {"c": clamp, "s": scale}}, accept=["hooks"])  # accepted by name


def test_summary_seconds_cover_every_process_of_the_run(mine):
    eight = mine / "checkpoints" / "step-000000008.pt"
    before = ckpt.load(eight)["seconds"]
    t0 = time.perf_counter()
    summary = run(compose_config(*KEEP, f"trainer.resume={eight}"), mine)
    assert 0 < before < summary["seconds"] <= before + time.perf_counter() - t0


@pytest.mark.slow
def test_a_mid_epoch_resume_counts_the_whole_epochs_skipped_steps(tmp_path):
    boom = "+hooks.boom={modules: conv2, transforms: [{name: scale, factor: 1e300}]}"  # every step non-finite
    skip_all = [*KEEP, "trainer.nonfinite=skip", boom]
    run(compose_config(*skip_all), tmp_path)
    eight = tmp_path / "checkpoints" / "step-000000008.pt"  # 2 of epoch 2's 6 steps done
    run(compose_config(*skip_all, f"trainer.resume={eight}"), tmp_path)
    records = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped_steps"] for r in records] == [6, 6]


@pytest.mark.slow
def test_zclip_statistics_after_a_resume_are_bit_identical(tmp_path):
    """One window of 30 norms, resumed after 21: summed as one run sums them, to the last bit."""
    zclip = [
        *(o for o in RESUMABLE if not o.startswith(("+hooks", "data.train_size", "trainer.epochs"))),
        "data.train_size=300",
        "trainer.epochs=1",
        "trainer.checkpoint_every_steps=7",
        "trainer.log_every=1000",
        "trainer.checkpoint_keep=10",
        "+hooks=[zclip,log]",
        "hooks.zclip.transforms.0.warmup_steps=3",
    ]
    run(compose_config(*zclip), tmp_path)
    uninterrupted = (tmp_path / "grad_stats.jsonl").read_text()
    run(compose_config(*zclip, f"trainer.resume={tmp_path / 'checkpoints' / 'step-000000021.pt'}"), tmp_path)
    assert (tmp_path / "grad_stats.jsonl").read_text() == uninterrupted
