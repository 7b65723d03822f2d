"""Soak: a random sequence of what users do to one run folder (fresh runs, resume=auto, a
resume from an older step, another run's checkpoint, changed keys, SIGTERM and SIGKILL at
random steps, a continuation of the finished run SIGKILLed, truncated checkpoints,
``checkpoints/`` a link to another run's), checking after each step that a finished run's
files changed only by its own successful continuation, that no file of another run was
deleted or changed, and that summary.json is valid JSON saying what happened (a killed
run's ``running`` reads as ``killed``).

``GRADMOD_SOAK_SEED`` and ``GRADMOD_SOAK_STEPS`` choose another sequence or a longer one.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import pytest
from helpers import RESUMABLE, run_train

from gradmod.reporting import run_summary
from gradmod.run.folder import checkpoint_file as ckpt

KEEP = [*RESUMABLE, "trainer.checkpoint_keep=3"]
ACTIONS = ("fresh", "auto", "older", "foreign", "changed", "kill", "term", "truncate", "continue_kill", "linked")


def snapshot(out: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(out)): p.read_bytes()
        for p in sorted(out.rglob("*"))
        if p.is_file()
        and p.relative_to(out) not in (Path(".gradmod/lock"), Path(".gradmod/lock.pid"))  # the holder's, not the run's
        and "data" not in p.relative_to(out).parts
    }


def own_checkpoints(out: Path) -> list[Path]:
    run = json.loads((out / ".gradmod" / "run.json").read_text())["run_id"]
    return ckpt.checkpoints(out / "checkpoints", run)


def _verifies(path: Path) -> bool:
    try:
        ckpt.load(path)
    except ckpt.CheckpointError:
        return False
    return True


def act(action: str, out: Path, foreign: Path, rng: random.Random):
    """Do ``action``; returns the process (None for a change made by hand)."""
    if action == "linked":
        return linked(out, foreign.parent, rng)
    mine = own_checkpoints(out) if (out / ".gradmod" / "run.json").exists() else []
    if action == "truncate":
        if mine:
            path = rng.choice(mine)
            path.write_bytes(path.read_bytes()[: rng.randrange(1, path.stat().st_size)])
        return None
    resume = {
        "fresh": [],
        "auto": ["trainer.resume=auto"],
        "changed": ["trainer.resume=auto", "seed=5"],
        "foreign": [f"trainer.resume={foreign}"],
    }.get(action, ["trainer.resume=auto"])
    usable = [p for p in mine if _verifies(p)]
    if action in ("older", "kill", "term") and usable:  # from the oldest: a new timeline, steps left to kill at
        resume = [f"trainer.resume={usable[0]}"]
    env = None
    if action == "continue_kill":  # the finished run continued for a third epoch, killed in it
        resume = ["trainer.resume=auto", "trainer.epochs=3"]
        last = max((ckpt.step_of(p) for p in usable), default=0)
        env = {"GRADMOD_KILL_AT": f"step:{rng.randint(max(13, last + 1), 17)}"}  # before its end (18)
    if action in ("kill", "term"):
        first = ckpt.step_of(usable[0]) + 1 if usable else 1
        env = {"GRADMOD_KILL_AT": f"step:{rng.randint(min(first, 11), 11)}", "GRADMOD_KILL_SIGNAL": action.upper()}
    return run_train(out, *KEEP, *resume, check=False, env=env)


def linked(out: Path, theirs: Path, rng: random.Random):
    """``checkpoints/`` made a link to another run's, then a run that would delete or move
    checkpoints there (start_over, or a resume from an older step); the link is undone after."""
    held = out.parent / "held-checkpoints"
    (out / "checkpoints").rename(held)
    (out / "checkpoints").symlink_to(theirs)
    try:
        how = rng.choice([["trainer.start_over=true"], [f"trainer.resume={ckpt.checkpoints(theirs)[0]}"]])
        return run_train(out, *KEEP, *how, check=False)
    finally:
        (out / "checkpoints").unlink()
        held.rename(out / "checkpoints")


@pytest.mark.slow
def test_soak_a_finished_run_is_changed_only_by_its_own_continuation(tmp_path):
    rng = random.Random(int(os.environ.get("GRADMOD_SOAK_SEED", "5")))
    other = tmp_path / "other"
    run_train(other, *KEEP, "seed=7")
    foreign = ckpt.checkpoints(other / "checkpoints")[0]
    out = tmp_path / "run"
    run_train(out, *KEEP)
    planted = out / "checkpoints" / "step-000000099.pt"  # another run's checkpoint: never deleted
    shutil.copy(ckpt.checkpoints(other / "checkpoints")[-1], planted)
    planted_bytes = planted.read_bytes()
    theirs = snapshot(other)
    done = []
    for _ in range(int(os.environ.get("GRADMOD_SOAK_STEPS", "12"))):
        action = rng.choice(ACTIONS)
        before = snapshot(out)
        proc = act(action, out, foreign, rng)
        done.append(action)
        print(action, proc.returncode if proc else "-", flush=True)
        where = f"after {done}: {proc.stderr[-2000:] if proc else ''}"
        assert planted.read_bytes() == planted_bytes, where
        assert snapshot(other) == theirs, where  # nothing of another run changed, through a link or not
        summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else None
        if proc is None:
            continue
        if proc.returncode == 0:
            assert summary["status"] == "ok", where
            run_id = json.loads((out / ".gradmod" / "run.json").read_text())["run_id"]
            assert summary["run"] == run_id and summary["steps"] == 12, where
        elif proc.returncode == 2:  # refused: one line, every file as it was
            assert proc.stderr.startswith("error: ") and len(proc.stderr.strip().splitlines()) == 1, where
            assert snapshot(out) == before, where
        elif proc.returncode == 143:
            assert summary["status"] == "interrupted" and summary["signal"] == "SIGTERM", where
        else:
            assert action in ("kill", "continue_kill") and proc.returncode == -9, where
            assert summary["status"] == "running" and run_summary.read(out)["status"] == "killed", where
        if action == "linked":
            assert proc.returncode == 2 and "is a link to" in proc.stderr, where
