"""LAMB's fused step (``gradmod.optim.lamb``, taken inside ``gradmod.optim.Adam``) against the step
hooks of ``gradmod.optim.trust_ratio`` that rescale any optimizer's step: the same steps, in every
setting the fused step takes; the groups it does not take keep the hooks."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import gradmod
from gradmod.optim import lamb

STEPS = 8
LAMB = {"of": "update", "clamp": 10.0, "eps": 1e-6}


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, 3)).double()


def spec(trust=None, **kwargs):
    out = {"_target_": "gradmod.optim.Adam", "lr": 0.05, "eps": 1e-6, "bias_correction": False, **kwargs}
    out["groups"] = [{"params": "*", "exclude": "@vectors", "trust_ratio": {**LAMB, **(trust or {})}}]
    return out


def stepped(net, opt):
    """``STEPS`` steps of ``opt`` on ``net``, the same batches each time; the step counts of its state."""
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        x, y = torch.randn(5, 6, dtype=torch.float64, generator=g), torch.randint(0, 3, (5,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
    return [s["step"].item() for s in opt.state.values()]


def fused_and_hooked(mine_spec, theirs):
    """The largest difference after ``STEPS`` steps of ``gradmod.optimizer(net, mine_spec)`` (fused)
    and ``theirs(net)`` (hooks), and both step counts."""
    net = model()
    other = copy.deepcopy(net)
    mine, ref = gradmod.optimizer(net, mine_spec), theirs(other)
    assert [mine.takes_trust_ratio(g) for g in mine.param_groups] == [False, True]
    counts = stepped(net, mine), stepped(other, ref)
    assert max((a - b).abs().max().item() for a, b in zip(net.parameters(), model().parameters())) > 1e-3
    return max((a - b).abs().max().item() for a, b in zip(net.parameters(), other.parameters())), counts


@pytest.mark.parametrize(
    ("trust", "kwargs"),
    [
        ({}, {"weight_decay": 0.01, "decoupled_weight_decay": True}),
        ({"mode": "clip", "eta": 50.0}, {}),  # ratios over 1: the clip binds
        ({"clamp": None, "eps": 0.0}, {"bias_correction": True}),
        ({"clamp": 0.5}, {"weight_decay": 0.1, "maximize": True}),  # L2 decay, inside the update
        ({}, {"weight_decay": 0.01, "decoupled_weight_decay": True, "bias_correction": True, "betas": (0.8, 0.9)}),
    ],
)
def test_the_fused_step_is_the_hooks_step(trust, kwargs):
    def hooked(net):  # foreach: false keeps torch's own step, and the hooks rescale it
        opt = gradmod.optimizer(net, spec(trust, foreach=False, **kwargs))
        assert not any(opt.takes_trust_ratio(g) for g in opt.param_groups)
        return opt

    diff, (mine, theirs) = fused_and_hooked(spec(trust, **kwargs), hooked)
    assert diff <= 1e-12
    assert mine == theirs == [STEPS] * len(mine)


def test_the_fused_step_is_torchs_adamw_with_the_hooks():
    """torch's own AdamW (bias-corrected), rescaled by the hooks: what the fused step takes."""
    settings = {"lr": 0.05, "eps": 1e-6, "weight_decay": 0.01}
    mine = spec(**settings, decoupled_weight_decay=True, bias_correction=True)
    theirs = {**mine, "_target_": "torch.optim.AdamW"}
    del theirs["decoupled_weight_decay"], theirs["bias_correction"]
    diff, _ = fused_and_hooked(mine, lambda net: gradmod.optimizer(net, theirs))
    assert diff <= 1e-12


@pytest.mark.parametrize(
    "group",
    [
        {"amsgrad": True},
        {"foreach": False},
        {"differentiable": True},
        {"trust_ratio": {"of": "grad"}},
        {"trust_ratio": None},
    ],
)
def test_what_the_fused_step_leaves_to_the_hooks(group):
    base = {"params": [torch.zeros(2, 2)], "amsgrad": False, "foreach": None, "trust_ratio": {"of": "update"}}
    assert lamb.fits(base)
    assert not lamb.fits({**base, **group})
    assert not lamb.fits({**base, "params": [torch.zeros(2, 2, dtype=torch.complex64)]})


def test_the_step_keeps_torchs_closure_and_hooks():
    net = model()
    opt = gradmod.optimizer(net, spec())
    calls = []
    opt.register_step_pre_hook(lambda *_: calls.append("pre"))
    opt.register_step_post_hook(lambda *_: calls.append("post"))
    x, y = torch.randn(5, 6, dtype=torch.float64), torch.randint(0, 3, (5,))

    def closure():
        opt.zero_grad()
        loss = nn.functional.cross_entropy(net(x), y)
        loss.backward()
        return loss

    before = [p.detach().clone() for p in net.parameters()]
    loss = opt.step(closure)
    assert calls == ["pre", "post"] and loss is not None
    assert all(not torch.equal(a, b) for a, b in zip(before, net.parameters()))


def test_a_checkpoint_resumes_the_fused_step():
    net = model()
    opt = gradmod.optimizer(net, spec(weight_decay=0.01, decoupled_weight_decay=True))
    stepped(net, opt)
    again = copy.deepcopy(net)
    resumed = gradmod.optimizer(again, spec(weight_decay=0.01, decoupled_weight_decay=True))
    resumed.load_state_dict(copy.deepcopy(opt.state_dict()))
    counts = stepped(net, opt), stepped(again, resumed)
    assert counts[0] == counts[1] == [2 * STEPS] * len(counts[0])
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), again.parameters()))
