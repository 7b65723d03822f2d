"""Non-finite gradients: counted raw (before transforms), then skip | raise | warn."""

from __future__ import annotations

import copy
import json
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradmod.app.cli import run
from gradmod.hooks import attach
from gradmod.training.nonfinite import NonFiniteError, NonFiniteGuard
from gradmod.training.trainer import bare_epoch

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
