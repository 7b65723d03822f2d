"""Rules that change over training, in the trainer: a run resumed from a mid-epoch
checkpoint inside a freeze window ends bitwise equal to the uninterrupted run, with a
scheduled bound, annealed noise and the window in play; the shipped configs compose."""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers import ROOT, TINY_FAKE, compose_config, same_params

from gradmod.app.cli import run
from gradmod.run.folder import checkpoint_file

TIMED = [
    *TINY_FAKE,
    f"hydra.searchpath=[file://{ROOT}/tests/support/timed_conf]",
    "+hooks=timed_all",  # freeze_warmup (the first epoch) and a noise -> scheduled clamp rule
    "trainer.accumulate=2",  # 3 optimizer steps per epoch, 6 in all
    "trainer.log_every=1",
    "trainer.checkpoint_every_steps=2",
    "trainer.checkpoint_keep=10",
]


def test_resume_inside_a_freeze_window_is_bitwise_equal(tmp_path):
    full = tmp_path / "full"
    run(compose_config(*TIMED), full)
    ckpt = full / "checkpoints" / "step-000000002.pt"
    saved = checkpoint_file.load(ckpt)
    assert saved["hooks"]["clock"]["t"] == 2  # inside [0, 3): the freeze window
    resumed = tmp_path / "resumed"  # what resume=auto finds after a kill, forked into a new folder
    summary = run(compose_config(*TIMED, f"trainer.resume={ckpt}"), resumed)
    assert summary["resumed_from"].endswith(ckpt.name) and summary["steps"] == 6
    same_params(torch.load(resumed / "model.pt"), torch.load(full / "model.pt"))
    lines = [json.loads(x) for x in (full / "grad_stats.jsonl").read_text().splitlines()]
    assert [r["stats"]["freeze_warmup/active"]["value"] for r in lines] == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    metrics = [json.loads(x) for x in (full / "metrics.jsonl").read_text().splitlines()]
    assert [r["grad_stats"]["freeze_warmup/active"]["value"] for r in metrics] == [1.0, 0.0]
    bounds = [r["stats"]["ramp/clamp.bound"]["value"] for r in lines]
    assert bounds == pytest.approx([0.002 + 0.018 * (1 + math.cos(math.pi * t / 6)) / 2 for t in range(6)])
    assert (full / "schedules.png").is_file()
    after = [json.loads(x) for x in (resumed / "grad_stats.jsonl").read_text().splitlines()]
    assert after == lines[2:]  # the new folder's file starts after the checkpoint's step


def test_shipped_configs_compose_and_sweeps_reach_inside_a_schedule():
    cfg = compose_config("+hooks=[grl,freeze_warmup]", "hooks.grl.transforms.0.factor.end=-0.5")
    assert cfg.hooks.grl.transforms[0].factor.end == -0.5 and cfg.hooks.grl.transforms[0].factor.schedule == "dann"
    assert cfg.hooks.freeze_warmup.active.until == "1ep"


def test_gradual_unfreeze_trains_one_depth_more_each_epoch(tmp_path):
    """``+hooks=gradual_unfreeze`` on the MNIST CNN: l1 alone in epoch 0, conv2 from epoch 1,
    conv1 from epoch 2; a frozen layer's weights are bitwise those of the epoch before."""
    run(
        compose_config(*TINY_FAKE, "+hooks=gradual_unfreeze", "trainer.epochs=3", "trainer.checkpoint_keep=10"),
        tmp_path,
    )
    ends = [
        checkpoint_file.load(p)["model"] for p in sorted((tmp_path / "checkpoints").glob("step-*.pt"))
    ]  # each epoch's end (6 steps)
    assert len(ends) == 3
    moved = [{k.split(".")[0] for k in ends[0] if not torch.equal(a[k], b[k])} for a, b in zip(ends, ends[1:])]
    assert moved == [{"conv2", "l1"}, {"conv1", "conv2", "l1"}]  # epochs 1 and 2
