"""The per_sample stage follows ``requires_grad`` at every backward, against a hand-written
DP-SGD step (torch.func's per-example gradients of the parameters that train, each
example's clipped, summed, noised from a generator seeded alike, divided by the batch): a
parameter frozen after attach keeps ``.grad = None``, one frozen at attach and unfrozen
later is clipped and noised with the rule its globs name, one outside the noisy rule is
refused in one line."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

from gradmod.hooks import attach

MAX_NORM, SIGMA = 0.3, 0.7


def dp(params="*") -> dict:
    clip = {"name": "per_sample_clip", "max_norm": MAX_NORM, "noise_multiplier": SIGMA}
    return {"dp": {"params": params, "transforms": [clip]}}


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 5), nn.Tanh(), nn.Linear(5, 3)).double()


def batch(step: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 + step)
    return torch.randn(n, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,), generator=g)


def dp_sgd(model: nn.Module, order: list[str], x, y, seed: int) -> dict[str, torch.Tensor]:
    """By hand: the per-example gradients of the parameters ``order`` names (those that train,
    in the order the noise is drawn), flat-clipped, summed, noised, divided by the batch."""
    train = {n: p.detach() for n, p in model.named_parameters() if n in order}
    rest = {n: p.detach() for n, p in model.named_parameters() if n not in order}

    def loss(params, xi, yi):
        out = functional_call(model, {**params, **rest}, (xi[None],))
        return F.cross_entropy(out, yi[None])

    per = vmap(grad(loss), in_dims=(None, 0, 0))(train, x, y)
    norms = torch.sqrt(sum(g.flatten(1).square().sum(1) for g in per.values()))
    factor = (MAX_NORM / (norms + 1e-6)).clamp(max=1.0)
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for n in order:
        s = torch.tensordot(factor, per[n], 1)
        s = s + SIGMA * MAX_NORM * torch.randn(s.shape, generator=gen, dtype=s.dtype)
        out[n] = s / len(y)
    return out


def step(model: nn.Module, hooks, t: int, seed: int) -> None:
    hooks.stage("per_sample").generator = torch.Generator().manual_seed(seed)
    model.zero_grad(set_to_none=True)
    x, y = batch(t)
    F.cross_entropy(model(x), y).backward()
    hooks.after_backward()


def test_unfrozen_later_is_clipped_and_noised_with_its_rule_and_frozen_later_gets_nothing():
    model = mlp()
    model[0].requires_grad_(False)  # frozen at attach: the rule's "*" covers it once it trains
    hooks = attach(model, dp())
    step(model, hooks, 0, seed=1)
    assert model[0].weight.grad is None and model[2].weight.grad is not None
    model[0].requires_grad_(True)
    model[2].requires_grad_(False)  # frozen after attach: no gradient, no noise
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    still = [p.detach().clone() for p in model[2].parameters()]
    for t, seed in ((1, 2), (2, 3)):  # the backward after the change, and one more
        step(model, hooks, t, seed)
        # the noise in the rule's order: its parameters trainable at attach, then those frozen then
        want = dp_sgd(model, ["4.weight", "4.bias", "0.weight", "0.bias"], *batch(t), seed)
        for n, p in model.named_parameters():
            if n.startswith("2."):
                assert p.grad is None, n
            else:
                torch.testing.assert_close(p.grad, want[n], rtol=1e-10, atol=1e-12, msg=n)
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(model[2].parameters(), still))


def test_a_freeze_window_beside_a_noisy_rule_narrows_the_clipping_to_what_trains():
    """``freeze`` switches requires_grad: the per_sample stage clips and noises the head alone
    inside the window, every parameter after it."""
    model = mlp()
    rules = {**dp(), "warm": {"params": "*", "exclude": "4.*", "transforms": ["freeze"], "active": {"until": 1}}}
    hooks = attach(model, rules)
    step(model, hooks, 0, seed=4)
    want = dp_sgd(model, ["4.weight", "4.bias"], *batch(0), 4)
    assert [n for n, p in model.named_parameters() if p.grad is not None] == ["4.weight", "4.bias"]
    torch.testing.assert_close(model[4].weight.grad, want["4.weight"], rtol=1e-10, atol=1e-12)
    step(model, hooks, 1, seed=5)
    want = dp_sgd(model, [n for n, _ in model.named_parameters()], *batch(1), 5)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=1e-10, atol=1e-12, msg=n)


def test_unfrozen_outside_the_noisy_rule_is_refused_in_one_line_at_its_backward():
    model = mlp()
    model[0].requires_grad_(False)
    model[4].requires_grad_(False)
    hooks = attach(model, dp("2.*"))
    step(model, hooks, 0, seed=1)
    model[4].requires_grad_(True)
    with pytest.raises(ValueError) as e:
        step(model, hooks, 1, seed=2)
    assert "\n" not in str(e.value)
    assert "hooks.dp: '4.weight' trains now (requires_grad=True) outside that rule (no rule)" in str(e.value)
