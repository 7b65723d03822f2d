"""Hook-stage chains of in-place-able transforms may run at the end of backward on .grad;
wherever something would see the gradient in between, they run in the hook as before."""

from __future__ import annotations

import torch
from torch import nn

from gradmod.hooks import attach

CLIP = {"clip": {"params": "*", "transforms": [{"name": "clamp", "bound": 0.1}]}}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(6, 4)


def _loss(model: nn.Module) -> torch.Tensor:
    return (model(torch.randn(8, 6, generator=torch.Generator().manual_seed(1))) * 10).sum()


def test_backward_gives_the_clamped_raw_gradient():
    raw = _model()
    _loss(raw).backward()
    model = _model()
    with attach(model, CLIP):
        _loss(model).backward()
    for p, q in zip(model.parameters(), raw.parameters()):
        assert torch.equal(p.grad, q.grad.clamp(-0.1, 0.1))
        assert q.grad.abs().max() > 0.1  # the bound bites


def test_autograd_grad_and_later_hooks_see_the_transformed_gradient():
    raw = _model()
    want = [g.clamp(-0.1, 0.1) for g in torch.autograd.grad(_loss(raw), list(raw.parameters()))]
    model = _model()
    with attach(model, CLIP):
        got = torch.autograd.grad(_loss(model), list(model.parameters()))
        assert all(torch.equal(a, b) for a, b in zip(got, want))  # nothing accumulates: the hook clamps
        seen = []
        model.weight.register_hook(lambda g: seen.append(g.abs().max().item()))
        _loss(model).backward()
        assert seen and seen[0] <= 0.1 + 1e-7  # a hook after the chain sees its result (0.1 in float32)
        assert model.bias.grad.abs().max() <= 0.1 + 1e-7


def test_accumulation_clamps_each_backward_before_the_sum():
    raw = _model()
    _loss(raw).backward()
    one = raw.weight.grad.clamp(-0.1, 0.1)
    model = _model()
    with attach(model, CLIP):
        _loss(model).backward()
        _loss(model).backward()  # .grad is held now: this one is clamped in its hook, then added
    assert torch.equal(model.weight.grad, one + one)


def test_backward_on_some_inputs_and_autograd_grad_in_turn_each_get_the_clamped_gradient():
    raw = _model()
    raw_grads = torch.autograd.grad(_loss(raw), list(raw.parameters()))
    model = _model()
    with attach(model, CLIP):
        for _ in range(2):  # each backward decides for itself, whatever the one before did
            model.zero_grad(set_to_none=True)
            _loss(model).backward(inputs=[model.weight])
            assert model.bias.grad is None and torch.equal(model.weight.grad, raw_grads[0].clamp(-0.1, 0.1))
            got = torch.autograd.grad(_loss(model), [model.bias])
            assert torch.equal(got[0], raw_grads[1].clamp(-0.1, 0.1))
            assert torch.equal(model.weight.grad, raw_grads[0].clamp(-0.1, 0.1))  # autograd.grad left .grad alone
