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


def test_autograd_grad_gets_torchs_gradient_and_later_hooks_see_the_transformed_one():
    raw = _model()
    want = torch.autograd.grad(_loss(raw), list(raw.parameters()))
    model = _model()
    with attach(model, CLIP):
        got = torch.autograd.grad(_loss(model), list(model.parameters()))
        assert all(torch.equal(a, b) for a, b in zip(got, want))  # nothing accumulates: the rule does not act
        assert max(g.abs().max() for g in got) > 0.1  # the bound would bite
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


def test_backward_on_some_inputs_is_clamped_and_autograd_grad_in_turn_is_torchs():
    raw = _model()
    raw_grads = torch.autograd.grad(_loss(raw), list(raw.parameters()))
    model = _model()
    with attach(model, CLIP):
        for _ in range(2):  # each backward decides for itself, whatever the one before did
            model.zero_grad(set_to_none=True)
            _loss(model).backward(inputs=[model.weight])
            assert model.bias.grad is None and torch.equal(model.weight.grad, raw_grads[0].clamp(-0.1, 0.1))
            got = torch.autograd.grad(_loss(model), [model.bias])
            assert torch.equal(got[0], raw_grads[1])
            assert torch.equal(model.weight.grad, raw_grads[0].clamp(-0.1, 0.1))  # autograd.grad left .grad alone


class _Mixed(nn.Module):
    """A big weight (observed alone), same-shape small tensors and small ones alone in their shape."""

    def __init__(self):
        super().__init__()
        self.big, self.a, self.b, self.head = (
            nn.Linear(200, 200),
            nn.Linear(200, 16),
            nn.Linear(16, 16),
            nn.Linear(16, 3),
        )

    def forward(self, x):
        return self.head(torch.relu(self.b(torch.relu(self.a(torch.relu(self.big(x)))))))


def test_a_logged_clamp_deferred_reports_the_bits_it_reports_in_the_hook(monkeypatch):
    """log, clamp, log: run on .grad at the end of backward (one foreach clamp), or in each
    tensor's hook (a clamp per tensor, as under accumulation): the same gradients and the
    same statistics to the last bit, a non-finite step included."""
    import copy
    import math

    from gradmod.hooks.hook import chain
    from gradmod.testing.opcount import OpCounter

    rules = {"c": {"params": "*", "transforms": ["log", {"name": "clamp", "bound": 1e-3}, "log"]}}
    torch.manual_seed(0)
    init = _Mixed()
    out = {}
    for deferred in (True, False):
        if not deferred:
            monkeypatch.setattr(chain, "_backward_may_defer", lambda acc: False)
        model = copy.deepcopy(init)
        with attach(model, rules) as hooks:
            for step in range(3):
                g = torch.Generator().manual_seed(step)
                x, y = torch.randn(8, 200, generator=g), torch.randint(0, 3, (8,), generator=g)
                model.zero_grad(set_to_none=True)
                scale = torch.tensor([1.0, math.inf, 1.0]) if step == 1 else torch.ones(3)
                with OpCounter() as ops:
                    torch.nn.functional.cross_entropy(model(x) * scale, y).backward()
                clamps = sum(n for op, n in ops.by_op.items() if "clamp" in op)
            out[deferred] = (hooks.read_stats(), [p.grad.clone() for p in model.parameters()], clamps)
    (stats, grads, foreach), (stats_hook, grads_hook, per_tensor) = out[True], out[False]
    assert repr(stats) == repr(stats_hook)  # nan as nan
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_hook))
    assert stats["big.weight/post"]["frac_clipped"] > 0 and stats["big.weight/pre"]["nonfinite"] > 0
    assert foreach < per_tensor == len(grads)  # the deferred chain clamps all tensors in one foreach op
