"""A transform's result is checked on the first call of each hook; hook-stage `log`
statistics match an independent computation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import tiny_mlp

import gradmod
from gradmod.hooks import attach
from gradmod.testing.opcount import OpCounter

BAD = {
    "halve_in_place": (lambda: lambda g: g.mul_(0.5), "in place"),
    "wrong_shape": (lambda: lambda g: g.flatten(), "shape"),
    "wrong_dtype": (lambda: lambda g: g.double(), "dtype"),
    "not_a_tensor": (lambda: lambda g: 0.5, "returned float"),
}


@pytest.fixture(autouse=True)
def _bad_transforms():
    """Registered for each test (conftest restores the registry after it)."""
    for name, (factory, _) in BAD.items():
        gradmod.register(f"test_{name}", factory, overwrite=True)


def _model():
    return tiny_mlp(4, 3, 2)


def _backward(model):
    F.cross_entropy(model(torch.randn(5, 4)), torch.tensor([0, 1, 0, 1, 1])).backward()


@pytest.mark.parametrize("bad", list(BAD))
def test_a_bad_transform_is_one_line_naming_rule_transform_and_tensor(bad):
    model = _model()
    hooks = attach(model, {"odd": {"params": "2.weight", "transforms": ["log", f"test_{bad}"]}})
    with pytest.raises(ValueError) as e:
        _backward(model)
    msg = str(e.value)
    assert "\n" not in msg and "hooks.odd" in msg and f"test_{bad}" in msg and "'2.weight'" in msg
    assert BAD[bad][1] in msg
    hooks.remove()


def test_the_check_runs_on_the_first_call_only():
    model = _model()
    hooks = attach(model, {"c": {"params": "*", "transforms": [{"name": "clamp", "min": -0.1, "max": 0.1}]}})
    _backward(model)
    with OpCounter() as first_free:
        model.zero_grad(set_to_none=False)  # .grad held: the chain runs in each hook
        _backward(model)
    hooks.remove()
    bare = _model()
    _backward(bare)
    with OpCounter() as unhooked:
        bare.zero_grad(set_to_none=False)
        _backward(bare)
    assert first_free.count - unhooked.count == 4  # one clamp per parameter, nothing else
    assert first_free.by_op["aten.clamp.default"] == 4


def test_hook_stage_log_matches_an_independent_computation():
    model = _model()
    grads: dict[str, list[torch.Tensor]] = {}
    for n, p in model.named_parameters():  # registered first: sees the raw gradient
        p.register_hook(lambda g, n=n: grads.setdefault(n, []).append(g.double()))
    hooks = attach(
        model, {"c": {"params": "*", "transforms": ["log", {"name": "clamp", "min": -0.05, "max": 0.05}, "log"]}}
    )
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        _backward(model)
    stats = hooks.read_stats()
    for name, raw in grads.items():
        clipped = [g.clamp(-0.05, 0.05) for g in raw]
        for label, gs in (("pre", raw), ("post", clipped)):
            s = stats[f"{name}/{label}"]
            assert s["calls"] == 3
            assert s["norm"] == pytest.approx(sum(g.norm().item() for g in gs) / 3, rel=1e-5)
            assert s["mean"] == pytest.approx(sum(g.mean().item() for g in gs) / 3, rel=1e-5, abs=1e-9)
            assert s["min"] == pytest.approx(min(g.min().item() for g in gs), rel=1e-6)
            assert s["max"] == pytest.approx(max(g.max().item() for g in gs), rel=1e-6)
            assert s["frac_negative"] == pytest.approx(sum((g < 0).double().mean().item() for g in gs) / 3)
            assert s["nonfinite"] == 0
        expected = sum((c != r).double().mean().item() for c, r in zip(clipped, raw)) / 3
        assert stats[f"{name}/post"]["frac_clipped"] == pytest.approx(expected)
    hooks.remove()
