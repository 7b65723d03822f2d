"""A loop that forgets ``hooks.after_backward()`` is told so in one line, at the step or the next forward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradmod.hooks import attach

CLIP = {"clip": {"params": "*", "stage": "fused", "transforms": [{"name": "clamp", "bound": 0.01}]}}
MISSING = r"gradmod: hooks.after_backward\(\) was not called after the last backward; rules at stage fused \(clip\)"


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))


def _backward(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(6, 4, generator=g), torch.randint(0, 2, (6,), generator=g)
    F.cross_entropy(model(x), y).backward()


def test_optimizer_step_without_after_backward_is_refused():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    with attach(model, CLIP):
        _backward(model)
        with pytest.raises(RuntimeError, match=MISSING + " need it before optimizer.step"):
            opt.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))  # the step did not run


def test_a_step_without_an_optimizer_is_caught_at_the_next_forward():
    model = _model()
    with attach(model, CLIP):
        _backward(model)
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
        with pytest.raises(RuntimeError, match=MISSING):
            model(torch.randn(2, 4))


def test_accumulation_then_after_backward_passes_and_clamps_the_sum():
    model, ref = _model(), _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with attach(model, CLIP) as hooks:
        _backward(model, 1)
        _backward(model, 2)  # a second micro-batch: a forward with work due, parameters unchanged
        hooks.after_backward()
        opt.step()
        model(torch.randn(2, 4))  # the next step's forward
    _backward(ref, 1)
    _backward(ref, 2)
    with torch.no_grad():
        for p in ref.parameters():
            p -= 0.1 * p.grad.clamp(-0.01, 0.01)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q)


def test_per_sample_rules_need_it_too():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dp = {"dp": {"params": "*", "transforms": [{"name": "per_sample_clip", "max_norm": 1.0}]}}
    with attach(model, dp):
        _backward(model)
        with pytest.raises(RuntimeError, match=r"rules at stage per_sample \(dp\) need it"):
            opt.step()


def test_nothing_is_due_for_hook_rules_other_optimizers_or_removed_hooks():
    model, other = _model(), nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with attach(model, {"c": {"params": "*", "transforms": [{"name": "clamp", "bound": 0.01}]}}):
        _backward(model)
        opt.step()  # the hook stage acts during backward: nothing is due
    hooks = attach(model, CLIP)
    _backward(model)
    other(torch.randn(1, 2)).sum().backward()
    torch.optim.SGD(other.parameters(), lr=0.1).step()  # an optimizer of other parameters
    hooks.remove()
    opt.step()  # removed: its rules no longer apply
    model(torch.randn(2, 4))


def test_a_step_with_a_closure_is_not_refused_before_its_backward():
    """Lightning's accumulation: step(closure) runs the step's last backward and
    after_backward inside, after the pre-hook has seen the earlier micro-batch's due work."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with attach(model, CLIP) as hooks:
        _backward(model)  # the first micro-batch

        def closure():
            _backward(model)
            hooks.after_backward()

        opt.step(closure)
