"""autoclip and zclip against their packages (autoclip's QuantileClip, zclip's ZClip) on the
same gradients, step by step, and their state through HookSet.state_dict()."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradmod.hooks import attach

autoclip_pkg = pytest.importorskip("autoclip.torch", reason="the autoclip package is not installed (gradmod[dev])")
zclip_pkg = pytest.importorskip("zclip", reason="the zclip package is not installed (gradmod[dev])")

SPIKES = {7: 30.0, 12: 8.0, 13: 50.0, 20: 4.0}


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def backward(m: nn.Module, t: int) -> None:
    """A batch per step, its loss scaled up at the planted spikes."""
    m.zero_grad(set_to_none=True)
    g = torch.Generator().manual_seed(t)
    x, y = torch.randn(6, 5, generator=g), torch.randint(0, 3, (6,), generator=g)
    (F.cross_entropy(m(x), y) * SPIKES.get(t, 1.0 + 0.2 * t % 3)).backward()


def grads(m: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in m.parameters()]


@pytest.mark.parametrize("per_tensor", [False, True])
def test_autoclip_equals_quantileclip(per_tensor):
    ours, ref = model(), model()
    hooks = attach(
        ours,
        {
            "a": {
                "params": "*",
                "transforms": [{"name": "autoclip", "quantile": 0.5, "history": 6, "per_tensor": per_tensor}],
            }
        },
    )
    clipper = autoclip_pkg.QuantileClip(
        list(ref.parameters()), quantile=0.5, history_length=6, global_threshold=not per_tensor
    )
    clipped = 0
    for t in range(25):
        backward(ours, t)
        backward(ref, t)
        raw = grads(ref)
        hooks.after_backward()
        clipper.step()
        for a, b in zip(grads(ours), grads(ref)):
            assert torch.equal(a, b), t
        clipped += any(not torch.equal(a, b) for a, b in zip(grads(ref), raw))
    assert clipped >= 5  # the quantile bit
    assert hooks.read_stats()["a/autoclip"]["calls"] == 25


@pytest.mark.parametrize(
    "args, pkg",
    [
        ({"mode": "percentile"}, {"mode": "percentile"}),
        ({"mode": "zscore", "clip_option": "adaptive_scaling"}, {"mode": "zscore", "clip_option": "adaptive_scaling"}),
        (
            {"mode": "zscore", "clip_option": "mean", "max_grad_norm": 3.0},
            {"mode": "zscore", "clip_option": "mean", "max_grad_norm": 3.0},
        ),
        (
            {"mode": "zscore", "clip_factor": 0.7, "skip_update_on_spike": True},
            {"mode": "zscore", "clip_factor": 0.7, "skip_update_on_spike": True},
        ),
    ],
)
def test_zclip_equals_the_zclip_package(args, pkg):
    ours, ref = model(), model()
    rule = {"name": "zclip", "alpha": 0.9, "z_threshold": 1.5, "warmup_steps": 5, **args}
    hooks = attach(ours, {"z": {"params": "*", "transforms": [rule]}})
    clipper = zclip_pkg.ZClip(alpha=0.9, z_thresh=1.5, warmup_steps=5, **{"max_grad_norm": None, **pkg})
    for t in range(30):
        backward(ours, t)
        backward(ref, t)
        hooks.after_backward()
        clipper.step(ref)
        for a, b in zip(grads(ours), grads(ref)):
            torch.testing.assert_close(a, b, rtol=2e-6, atol=0, msg=f"step {t}")
    z = hooks.stage("fused")._groups[0][1]
    assert z.mean.item() == pytest.approx(clipper.mean, rel=1e-6) and z.var.item() == pytest.approx(
        clipper.var, rel=1e-5
    )
    assert hooks.read_stats()["z/zclip"]["frac_clipped"] > 0


@pytest.mark.parametrize(
    "transform",
    [
        {"name": "autoclip", "quantile": 0.3, "history": 4, "per_tensor": True},
        {"name": "zclip", "mode": "zscore", "warmup_steps": 3},
    ],
)
def test_history_survives_a_resume_bit_for_bit(transform):
    rules = {"h": {"params": "*", "transforms": [transform]}}
    whole = model()
    hooks = attach(whole, rules)
    for t in range(16):
        backward(whole, t)
        hooks.after_backward()
    first = model()
    hooks_a = attach(first, rules)
    for t in range(8):
        backward(first, t)
        hooks_a.after_backward()
    state = copy.deepcopy(hooks_a.state_dict())
    second = model()
    hooks_b = attach(second, rules)
    hooks_b.load_state_dict(state)
    for t in range(8, 16):
        backward(second, t)
        hooks_b.after_backward()
    assert all(torch.equal(a, b) for a, b in zip(grads(whole), grads(second)))


@pytest.mark.parametrize(
    "transform, words",
    [
        ({"name": "autoclip", "quantile": 1.5}, "quantile=1.5 must be in [0, 1]"),
        ({"name": "autoclip", "history": 0}, "history=0 must be an int >= 1"),
        ({"name": "zclip", "mode": "median"}, "mode='median'; allowed: percentile, zscore"),
        ({"name": "zclip", "clip_option": "max"}, "clip_option='max'; allowed: adaptive_scaling, mean"),
    ],
)
def test_bad_arguments_are_one_line(transform, words):
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        attach(model(), {"h": {"params": "*", "transforms": [transform]}})
