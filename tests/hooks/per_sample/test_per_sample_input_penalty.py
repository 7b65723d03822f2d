"""per_sample rules (DP-SGD's clip, scores) beside the shipped ``input_grad_penalty``: each example's
loss holds its own penalty, ``loss_i + w ||d loss_i / d x_i||^p``, and each example's gradient of it
equals ``torch.func``'s (``vmap`` over ``grad`` of the penalized loss of one example) in float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from penalties import per_example_input_penalty
from torch import nn
from torch.func import functional_call, grad, vmap

from gradmod.hooks import attach

W, C = 0.3, 0.5


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x):
        h = torch.tanh(self.fc2(torch.tanh(self.fc1(x))))
        return self.fc3(h.mean(1) if x.dim() == 3 else h)


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, stride=2, padding=1)
        self.conv2 = nn.Conv1d(4, 3, 2, groups=1)
        self.fc = nn.Linear(9, 3)

    def forward(self, x):
        h = torch.tanh(self.conv(x))  # [B, 4, 3, 3]
        h = torch.tanh(self.conv2(h.flatten(2)))  # [B, 3, 8]
        return self.fc(h[:, :, :3].flatten(1))


class LayerNormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.ln, self.fc2 = nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(self.ln(torch.tanh(self.fc1(x))))


class GRUNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.gru, self.fc2 = nn.Linear(6, 8), nn.GRU(8, 8, batch_first=True), nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(self.gru(torch.tanh(self.fc1(x)))[0][:, -1])


class AttentionNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.attn, self.fc2 = nn.Linear(6, 8), nn.MultiheadAttention(8, 2, batch_first=True), nn.Linear(8, 3)

    def forward(self, x):
        h = torch.tanh(self.fc1(x))
        return self.fc2(self.attn(h, h, h, need_weights=False)[0].mean(1))


class Twice(nn.Module):
    """fc2 called twice in one forward."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x):
        return self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))))


class Tied(nn.Module):
    """One weight held by two Linear modules."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.out = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 3)
        self.fc2.weight = self.fc1.weight

    def forward(self, x):
        return self.out(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


class GroupedConv(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 6, 3, groups=2, dilation=2, padding=2, padding_mode="circular")
        self.fc = nn.Linear(6 * 5 * 5, 3)

    def forward(self, x):
        return self.fc(torch.tanh(self.conv(x)).flatten(1))


class HFConv1D(nn.Module):
    """Hugging Face's Conv1D (GPT-2's Linear, its weight stored [in, out])."""

    def __init__(self):
        from transformers.pytorch_utils import Conv1D

        super().__init__()
        self.a, self.b = Conv1D(8, 6), Conv1D(3, 8)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _model(cls, seed=0):
    torch.manual_seed(seed)
    return cls().double()


def _batch(shape, seed=1, n=12):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, *shape, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,), generator=g)


def _per_example(model, x, y, power, at=None, weight=W):
    """torch.func: each example's gradient of its own ``loss_i + weight ||d loss_i / d input||^power``, the
    input the model's (``at`` None) or ``fc2``'s."""
    if at is None:  # the model's input
        return per_example_input_penalty(model, x, y, weight, power)
    params = {n: p.detach() for n, p in model.named_parameters()}

    def penalized(ps, xi, yi):
        h = torch.tanh(F.linear(xi, ps["fc1.weight"], ps["fc1.bias"]))  # fc2's input

        def from_h(hi):
            z = F.linear(torch.tanh(F.linear(hi, ps["fc2.weight"], ps["fc2.bias"])), ps["fc3.weight"], ps["fc3.bias"])
            return F.cross_entropy(z[None], yi[None])

        return from_h(h) + weight * grad(from_h)(h).norm() ** power

    return vmap(grad(penalized), in_dims=(None, 0, 0))(params, x, y)


def _clipped_mean(per, n):
    flat = torch.cat([g.flatten(1) for g in per.values()], 1)
    factor = (C / (flat.norm(dim=1) + 1e-6)).clamp(max=1.0)
    return {k: torch.tensordot(factor, g, 1) / n for k, g in per.items()}


def _dp_step(model, rules, x, y):
    hooks = attach(model, rules)
    hooks.backward(F.cross_entropy(model(x), y))
    hooks.after_backward()
    return hooks


def _rules(at="@input", power=2, every=None):
    penalty = {"name": "input_grad_penalty", "weight": W, "power": power}
    if every:
        penalty["every"] = every
    return {
        "pen": {"modules": at, "transforms": [penalty]},
        "dp": {"params": "*", "transforms": [{"name": "per_sample_clip", "max_norm": C}]},
    }


def _close(model, want, tol=1e-9):
    err = max(float((p.grad - want[n]).abs().max()) for n, p in model.named_parameters())
    assert err <= tol, err


@pytest.mark.parametrize("power", [1, 2])
@pytest.mark.parametrize(("cls", "shape"), [(MLP, (6,)), (MLP, (5, 6)), (ConvNet, (2, 5, 5))])
def test_dp_clip_with_an_input_gradient_penalty_equals_vmap_of_grad(cls, shape, power):
    model, (x, y) = _model(cls), _batch(shape)
    want = _clipped_mean(_per_example(model, x, y, power), len(y))
    _dp_step(model, _rules(power=power), x, y).remove()
    _close(model, want)


@pytest.mark.parametrize(("cls", "shape"), [(Twice, (6,)), (Tied, (6,)), (GroupedConv, (4, 5, 5)), (HFConv1D, (6,))])
def test_layers_called_twice_tied_grouped_and_conv1d_equal_vmap_of_grad(cls, shape):
    model, (x, y) = _model(cls), _batch(shape)
    want = _clipped_mean(_per_example(model, x, y, 2), len(y))
    _dp_step(model, _rules(), x, y).remove()
    _close(model, want)


def test_a_penalty_on_a_hidden_modules_input_equals_vmap_of_grad():
    model, (x, y) = _model(MLP), _batch((6,))
    want = _clipped_mean(_per_example(model, x, y, 2, at="fc2"), len(y))
    _dp_step(model, _rules(at="fc2"), x, y).remove()
    _close(model, want)


def test_later_steps_with_detached_weights_and_every_equal_vmap_of_grad():
    """Step 0 checks against autograd, later ones run the clipped weights detached; ``every: 2``
    takes the term at steps 0 and 2 with twice the weight, and leaves steps 1 and 3 plain."""
    model, twin = _model(MLP), _model(MLP)
    hooks = attach(model, _rules(every=2))
    opt, topt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(twin.parameters(), lr=0.1)
    for step in range(4):
        x, y = _batch((6,), seed=10 + step)
        opt.zero_grad()
        hooks.backward(F.cross_entropy(model(x), y))
        hooks.after_backward()
        opt.step()
        want = _clipped_mean(_per_example(twin, x, y, 2, weight=2 * W), len(y))
        if step % 2 == 1:  # not due: the plain loss's per-example gradients
            params = {n: p.detach() for n, p in twin.named_parameters()}
            plain = lambda ps, xi, yi: F.cross_entropy(functional_call(twin, ps, (xi[None],)), yi[None])  # noqa: E731
            want = _clipped_mean(vmap(grad(plain), in_dims=(None, 0, 0))(params, x, y), len(y))
        for n, p in twin.named_parameters():
            p.grad = want[n].clone()
        topt.step()
        _close(model, want)
    hooks.remove()


def test_scores_grand_holds_each_examples_penalized_gradient():
    model, (x, y) = _model(MLP), _batch((6,))
    per = _per_example(model, x, y, 2)
    rules = {
        "pen": {"modules": "@input", "transforms": [{"name": "input_grad_penalty", "weight": W}]},
        "s": {"params": "*", "stage": "per_sample", "transforms": ["scores"]},
    }
    hooks = attach(model, rules)
    hooks.keeping_scores.see_batch(torch.arange(len(y)), y)
    hooks.backward(F.cross_entropy(model(x), y))
    hooks.after_backward()
    grand = hooks.stage("per_sample").take_scores()["grand"]
    want = torch.cat([g.flatten(1) for g in per.values()], 1).norm(dim=1)
    torch.testing.assert_close(grand, want, rtol=0, atol=1e-9)
    mean = {n: g.mean(0) for n, g in per.items()}  # scores alone: the gradient is autograd's whole one
    _close(model, mean)
    hooks.remove()


@pytest.mark.parametrize(
    ("cls", "shape", "where"),
    [
        (LayerNormNet, (6,), "'ln' (LayerNorm"),
        (GRUNet, (4, 6), "'gru' (GRU"),
        (AttentionNet, (4, 6), "'attn' (Multihead"),
    ],
)
def test_a_layer_without_a_second_order_part_is_one_line_before_the_step(cls, shape, where):
    model, (x, y) = _model(cls), _batch(shape)
    with pytest.raises(ValueError) as err:
        _dp_step(model, _rules(), x, y)
    line = str(err.value)
    assert "\n" not in line and f"module {where}" in line and "hooks.dp" in line
    assert all(p.grad is None for p in model.parameters())  # refused before the step's backward


def test_grad_penalty_beside_per_sample_is_one_line():
    rules = {
        "gp": {"params": "fc1.*", "transforms": [{"name": "grad_penalty", "weight": W}]},
        "dp": {"params": "*", "transforms": [{"name": "per_sample_clip", "max_norm": C}]},
    }
    with pytest.raises(ValueError, match=r"hooks\.gp: .*splits it into examples.*input_grad_penalty"):
        attach(_model(MLP), rules)
