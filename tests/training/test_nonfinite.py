"""Non-finite gradients: counted raw (before transforms), then skip | raise | warn. The
counts are counts of entries: huge finite gradients whose norm overflows are not
non-finite; NaN and inf entries are counted exactly, before and after clamp."""

from __future__ import annotations

import copy
import json
import logging
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradmod.app.cli import run
from gradmod.hooks import attach
from gradmod.testing.epochs import bare_epoch
from gradmod.training.nonfinite import NonFiniteError, NonFiniteGuard, count_nonfinite

# 1e300 is inf in a float32 gradient (a factor of inf itself is refused when the rule is built)
INF_AT_CONV2 = {"boom": {"modules": "conv2", "transforms": [{"name": "scale", "factor": 1e300}]}}
CLIP = {"clip": {"params": "*", "transforms": [{"name": "clamp", "min": -0.01, "max": 0.01}]}}


def test_clamp_does_not_hide_inf_from_the_raw_count():
    w = nn.Parameter(torch.ones(4))
    model = nn.Module()
    model.w = w
    hooks = attach(model, CLIP)
    (w * torch.tensor([float("inf"), 1.0, -float("inf"), 1.0])).sum().backward()
    assert torch.isfinite(w.grad).all()  # the clamp made the gradient finite...
    guard = NonFiniteGuard(model, hooks, policy="skip")
    assert guard.check()  # the step is skipped...
    assert guard.nonfinite == 2  # ...because the raw inf and -inf were counted first
    hooks.remove()


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.out = nn.Linear(3, 2)

    def forward(self, x):
        return self.out(torch.relu(self.fc(x)))


def _data(n=40):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 4, generator=g), torch.randint(0, 2, (n,), generator=g)


def _epoch(model, opt, x, y, hooks=None, guard=None):
    return bare_epoch(
        model, opt, x, y, batch_size=10, generator=torch.Generator().manual_seed(1), hooks=hooks, guard=guard
    )


@pytest.mark.parametrize("inject", ["nan_input", "inf_hook"])
def test_skip_leaves_parameters_and_optimizer_state_unchanged(inject):
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    x, y = _data()
    _epoch(model, opt, x, y)  # some real steps first, so Adam has state to protect
    params, state = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    hooks = attach(
        model,
        {"boom": {"modules": "fc", "transforms": [{"name": "scale", "factor": 1e300}]}, **CLIP}
        if inject == "inf_hook"
        else CLIP,
    )
    if inject == "nan_input":
        x = x.clone()
        x[:, 0] = float("nan")  # NaN inputs in every batch
    guard = NonFiniteGuard(model, hooks, "skip")
    loss = _epoch(model, opt, x, y, hooks, guard)
    assert guard.skipped == 4 and guard.bad_steps == 4 and guard.nonfinite > 0
    for k, v in params.items():
        assert torch.equal(model.state_dict()[k], v), k
    after = opt.state_dict()
    for i, s in state["state"].items():
        for k, v in s.items():
            assert torch.equal(after["state"][i][k], v), (i, k)
    hooks.remove()
    assert not torch.isfinite(torch.tensor(loss)) or inject == "inf_hook"


def test_raise_names_the_parameters():
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _data()
    x[0, 0] = float("inf")
    guard = NonFiniteGuard(model, None, "raise")
    with pytest.raises(NonFiniteError, match=r"trainer.nonfinite=raise: .*fc.weight"):
        _epoch(model, opt, x, y, guard=guard)


def test_raise_names_the_step_and_counts_on_from_a_checkpoint():
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _data()
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(1))  # _epoch's batch order
    x[order[25], 0] = float("inf")  # a sample of the third batch of 10
    fresh = NonFiniteGuard(model, None, "raise")
    with pytest.raises(NonFiniteError, match=r"non-finite gradient at step 3 in .*fc.weight"):
        _epoch(model, opt, x, y, guard=fresh)
    resumed = NonFiniteGuard(model, None, "raise")
    resumed.load_state_dict({**fresh.state_dict(), "steps": 10})  # as if 10 steps were done before
    with pytest.raises(NonFiniteError, match=r"at step 13 in"):
        _epoch(model, opt, x, y, guard=resumed)
    assert resumed.state_dict()["steps"] == 13


def test_warn_steps_anyway_and_reports_at_flush(caplog):
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _data()
    x[0, 0] = float("nan")  # the NaN batch is stepped: the parameters become NaN
    guard = NonFiniteGuard(model, None, "warn")
    _epoch(model, opt, x, y, guard=guard)
    assert guard.bad_steps == 0  # nothing read yet: no per-step sync
    with caplog.at_level(logging.WARNING, logger="gradmod.training.nonfinite"):
        guard.flush()
    assert guard.skipped == 0 and guard.bad_steps >= 1 and "stepped anyway" in caplog.text
    assert not torch.isfinite(model.fc.weight).all()


def test_transform_made_inf_is_caught_after_transforms():
    model = Tiny()
    hooks = attach(model, {"x": {"params": "out.bias", "transforms": [{"name": "scale", "factor": 1e300}]}})
    guard = NonFiniteGuard(model, hooks, "skip")
    F.cross_entropy(model(torch.randn(3, 4)), torch.tensor([0, 1, 0])).backward()
    guard.observe()
    assert guard.check() is True and guard.nonfinite == 0  # raw was finite; .grad was not
    hooks.remove()


def test_run_counts_skipped_steps_in_metrics_and_summary(compose_cfg, tmp_path):
    cfg = compose_cfg(
        "data=fake",
        "data.image_size=28",
        "data.channels=1",
        "data.train_size=30",
        "data.test_size=10",
        "data.batch_size=10",
        "trainer.epochs=2",
        "trainer.device=cpu",
        "trainer.progress=false",
        "trainer.checkpoint_every=0",
        "trainer.nonfinite=skip",
        "+hooks=clip",
        "+hooks.boom={modules: conv2, transforms: [{name: scale, factor: 1e300}]}",
    )
    summary = run(cfg, tmp_path)
    assert summary["skipped_steps"] == 6 and summary["nonfinite_steps"] == 6 and summary["nonfinite"] > 0
    records = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped_steps"] for r in records] == [3, 3]
    assert json.loads((tmp_path / "summary.json").read_text())["skipped_steps"] == 6


# ---- the counts: entries, exactly ----


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
