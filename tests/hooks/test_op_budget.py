"""Op budgets per training step: aten ops counted with OpCounter (deterministic, so a
real test where timings cannot be). MNIST CNN, Adam, one optimizer step of bare_epoch."""

from __future__ import annotations

import pytest
import torch

from gradmod.hooks import attach
from gradmod.models import MnistCNN
from gradmod.testing.epochs import bare_epoch
from gradmod.testing.opcount import OpCounter
from gradmod.training.nonfinite import NonFiniteGuard

CLAMP = {"name": "clamp", "min": -0.01, "max": 0.01}
RULES = {
    "bare": {},
    "clip": {"clip": {"params": "*", "transforms": [CLAMP]}},
    "clip_logged": {"clip_logged": {"params": "*", "transforms": ["log", CLAMP, "log"]}},
    "log": {"log": {"params": "*", "transforms": ["log"]}},
}


def step_ops(rules: str, stage: str = "hook", guard: bool = True) -> tuple[int, int]:
    """(ops of one optimizer step, hooked tensors); a first step warms caches up."""
    torch.manual_seed(0)
    model = MnistCNN()
    hooks = attach(model, RULES[rules], stage=stage)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randint(0, 255, (1, 1, 28, 28), dtype=torch.uint8)
    y = torch.tensor([3])
    kw = dict(
        batch_size=1,
        generator=torch.Generator().manual_seed(0),
        hooks=hooks,
        guard=NonFiniteGuard(model, hooks, "warn") if guard else None,
    )
    bare_epoch(model, opt, x, y, **kw)
    with OpCounter() as ops:
        bare_epoch(model, opt, x, y, **kw)
    hooks.remove()
    return ops.count, len(list(model.parameters()))


@pytest.fixture(scope="module")
def bare() -> int:
    return step_ops("bare", guard=False)[0]  # no hooks, no non-finite guard: the floor


def test_clip_at_the_hook_stage_costs_one_op_per_tensor_and_four_per_step(bare):
    ops, n = step_ops("clip")
    assert ops - bare <= n + 4, (ops, bare, n)


def test_clip_logged_costs_at_most_eleven_ops_per_observed_tensor(bare):
    ops, n = step_ops("clip_logged")
    assert ops - bare <= 11 * n, (ops, bare, n)


def test_log_and_fused_clip_and_the_guard_alone_stay_cheap(bare):
    n = step_ops("bare")[1]
    assert step_ops("bare")[0] - bare <= 4  # non-finite counting: a few ops per step, none per tensor
    assert step_ops("clip", stage="fused")[0] - bare <= 2 + 4 + 4  # two foreach clamps, the guard's counts
    assert step_ops("log")[0] - bare <= 5 * n


def test_op_counter_counts_each_dispatch():
    a = torch.ones(3)
    with OpCounter() as ops:
        b = a + 1
        (b * 2).sum()
    assert ops.count == 3 and ops.by_op["aten.add.Tensor"] == 1
    assert ops.top(1)[0][1] == 1
