"""Non-finite counts are counts of entries: huge finite gradients whose norm overflows
are not non-finite; NaN and inf entries are counted exactly, before and after clamp."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from gradmod.hooks import attach
from gradmod.training.nonfinite import NonFiniteGuard, count_nonfinite

CLIP = {"clip": {"params": "*", "transforms": [{"name": "clamp", "min": -0.01, "max": 0.01}]}}


def _model(grad: torch.Tensor) -> tuple[nn.Module, nn.Parameter]:
    model = nn.Module()
    model.w = nn.Parameter(torch.zeros_like(grad))
    return model, model.w


def _backward(w: nn.Parameter, grad: torch.Tensor) -> None:
    (w * grad).sum().backward()  # d/dw = grad, entries exactly as given


def _reference(grad: torch.Tensor) -> int:
    return int((~torch.isfinite(grad)).sum())


GRADS = {
    "huge_finite": torch.full((1000,), 1e30),  # every entry finite; the L2 norm overflows fp32
    "nan": torch.tensor([1.0, math.nan, 2.0, math.nan, 3.0]),
    "inf": torch.tensor([math.inf, -math.inf, 1e30, 0.0]),
}


@pytest.mark.parametrize("name", list(GRADS))
@pytest.mark.parametrize("rules", [None, CLIP], ids=["no_hooks", "clip"])
@pytest.mark.parametrize("policy", ["skip", "warn"])
def test_counts_are_entries_and_agree(name, rules, policy):
    grad = GRADS[name]
    assert not math.isfinite(torch.linalg.vector_norm(grad).item())  # an overflowing norm in every case
    truth = _reference(grad)
    model, w = _model(grad)
    hooks = attach(model, rules) if rules else None
    guard = NonFiniteGuard(model, hooks, policy)
    steps = 3
    for _ in range(steps):
        w.grad = None
        _backward(w, grad)
        guard.observe()
        skipped = guard.check()
        assert skipped == (policy == "skip" and truth > 0)
    guard.flush()
    assert guard.nonfinite == truth * steps
    assert guard.bad_steps == (steps if truth else 0)
    assert guard.skipped == (steps if truth and policy == "skip" else 0)
    if hooks is not None:
        hooks.remove()


def test_count_nonfinite_matches_isfinite():
    ts = [torch.randn(50, 7), torch.tensor([math.inf, math.nan, 1.0]), torch.full((3,), 3e38) * 10]
    ts[0][3, 4] = -math.inf
    assert [int(c) for c in count_nonfinite(ts)] == [_reference(t) for t in ts] == [1, 2, 3]


def test_lr_1e10_run_reports_no_nonfinite_steps(compose_cfg, tmp_path):
    """The robustness review's case: huge but finite gradients are not non-finite."""
    from gradmod.app.cli import run

    cfg = compose_cfg(
        "data=fake",
        "data.image_size=28",
        "data.channels=1",
        "data.train_size=40",
        "data.test_size=10",
        "data.batch_size=10",
        "trainer.epochs=1",
        "trainer.device=cpu",
        "trainer.progress=false",
        "trainer.checkpoint_every=0",
        "trainer.nonfinite=skip",
        "optimizer.lr=1e10",
    )
    summary = run(cfg, tmp_path)
    assert summary["nonfinite_steps"] == summary["skipped_steps"]
    assert (summary["nonfinite"] == 0) == (summary["nonfinite_steps"] == 0)
