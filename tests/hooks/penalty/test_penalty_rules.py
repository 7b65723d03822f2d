"""The shipped penalty rules (grad_penalty, input_grad_penalty) against hand-written loops in float64:
a penalty taken of torch's gradient, the other rules acting on the gradient of the whole loss."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from penalties import Net, batch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from gradmod.hooks import attach

W = 0.3


def _net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net().double()


def _gp(weight=W, **kw):
    return {"name": "grad_penalty", "weight": weight, **kw}


def _ip(weight=W, **kw):
    return {"name": "input_grad_penalty", "weight": weight, **kw}


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def _close(a, b, tol=1e-10):
    err = max(float((x - y).detach().abs().max()) for x, y in zip(a, b))
    assert err <= tol, err


def _param_term(loss, params, power):
    grads = torch.autograd.grad(loss, params, create_graph=True)
    norm = torch.cat([g.flatten() for g in grads]).norm()
    return norm**power


def _example_term(loss_of, x, y, power):
    """mean_i ||d loss_i / d x_i||^power, one example at a time (no batch trick)."""
    terms = []
    for i in range(len(y)):
        xi = (
            x[i : i + 1] if x.requires_grad else x[i : i + 1].detach().requires_grad_()
        )  # a hidden input keeps its graph
        (g,) = torch.autograd.grad(loss_of(xi, y[i : i + 1]), xi, create_graph=True)
        terms.append(g.norm() ** power)
    return torch.stack(terms).mean()


@pytest.mark.parametrize("power", [1, 2])
def test_grad_penalty_on_a_glob_with_a_hook_clamp_and_a_fused_clip_equals_a_hand_loop(power):
    x, y = batch()
    model, twin = _net(), _net()
    hooks = attach(
        model,
        {
            "gp": {"params": "fc1.*", "transforms": [_gp(power=power)]},
            "c": {"params": "fc2.*", "transforms": [{"name": "clamp", "bound": 0.02}]},
            "g": {"params": "*", "stage": "fused", "transforms": [{"name": "global_norm_clip", "max_norm": 0.5}]},
        },
    )
    hooks.backward(F.cross_entropy(model(x), y))
    hooks.after_backward()
    loss = F.cross_entropy(twin(x), y)
    (loss + W * _param_term(loss, list(twin.fc1.parameters()), power)).backward()
    for p in twin.fc2.parameters():
        p.grad.clamp_(-0.02, 0.02)
    torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.5)
    _close(_grads(model), _grads(twin))
    plain = _net()
    F.cross_entropy(plain(x), y).backward()
    assert max(float((a - b).abs().max()) for a, b in zip(_grads(model), _grads(plain))) > 1e-3  # it bites


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("power", [1, 2])
def test_input_grad_penalty_is_each_examples_own_input_gradient(reduction, power):
    x, y = batch()
    model, twin = _net(), _net()
    hooks = attach(model, {"ip": {"modules": "@input", "transforms": [_ip(power=power)]}}, loss_reduction=reduction)
    hooks.backward(F.cross_entropy(model(x), y, reduction=reduction))
    hooks.after_backward()
    loss = F.cross_entropy(twin(x), y, reduction=reduction)
    term = _example_term(lambda xi, yi: F.cross_entropy(twin(xi), yi), x, y, power)
    (loss + W * term).backward()
    _close(_grads(model), _grads(twin))


class _Tagger(nn.Module):
    """Token ids -> embedding -> a transformer layer -> a head on the first position."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, tokens):
        return self.head(self.layer(self.emb(tokens))[:, 0])


def test_input_grad_penalty_on_a_transformer_layers_input_equals_one_example_at_a_time():
    torch.manual_seed(0)
    model = _Tagger().double()
    twin = copy.deepcopy(model)
    tokens, y = torch.randint(0, 11, (6, 5)), torch.randint(0, 3, (6,))
    hooks = attach(model, {"ip": {"modules": "layer", "transforms": [_ip()]}})
    hooks.backward(F.cross_entropy(model(tokens), y))
    hooks.after_backward()
    with sdpa_kernel([SDPBackend.MATH]):  # the kernel whose backward has a backward
        h = twin.emb(tokens)
        loss = F.cross_entropy(twin.head(twin.layer(h)[:, 0]), y)
        term = _example_term(lambda hi, yi: F.cross_entropy(twin.head(twin.layer(hi)[:, 0]), yi), h, y, 2)
        (loss + W * term).backward()
    _close(_grads(model), _grads(twin))
    assert twin.emb.weight.grad.abs().sum() > 0  # the penalty reaches the embedding through the input


def test_input_grad_penalty_of_the_model_refuses_token_ids_in_one_line():
    model = _Tagger()
    hooks = attach(model, {"ip": {"modules": "@input", "transforms": [_ip()]}})
    with pytest.raises(ValueError, match=r"hooks\.ip: .*no floating-point tensor .*torch\.int64.*after the embedding"):
        model(torch.randint(0, 11, (2, 5)))
    hooks.remove()


class _GRU(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.GRU(3, 6, batch_first=True)
        self.head = nn.Linear(6, 2)

    def forward(self, x):
        return self.head(self.rnn(x)[0][:, -1])


def test_input_grad_penalty_on_a_gru_equals_one_example_at_a_time():
    torch.manual_seed(0)
    model = _GRU().double()
    twin = copy.deepcopy(model)
    x, y = torch.randn(5, 4, 3, dtype=torch.float64), torch.randint(0, 2, (5,))
    hooks = attach(model, {"ip": {"modules": "@input", "transforms": [_ip(power=1)]}})
    hooks.backward(F.cross_entropy(model(x), y))
    F_loss = F.cross_entropy(twin(x), y)
    (F_loss + W * _example_term(lambda xi, yi: F.cross_entropy(twin(xi), yi), x, y, 1)).backward()
    _close(_grads(model), _grads(twin))


def _steps_equal_a_hand_loop(rule: dict, weight_at, steps: int, **attach_kw) -> None:
    """``steps`` SGD steps of a penalty rule against a hand loop whose step ``t`` adds
    ``weight_at(t) * ||dL/dtheta||^2`` (none at 0)."""
    x, y = batch()
    model, twin = _net(), _net()
    hooks = attach(model, {"gp": rule}, **attach_kw)
    opt, ref = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(twin.parameters(), lr=0.1)
    for step in range(steps):
        hooks.backward(F.cross_entropy(model(x), y))
        hooks.after_backward()
        opt.step()
        opt.zero_grad()
        loss = F.cross_entropy(twin(x), y)
        if weight_at(step):
            loss = loss + weight_at(step) * _param_term(loss, list(twin.parameters()), 2)
        loss.backward()
        ref.step()
        ref.zero_grad()
    _close(list(model.parameters()), list(twin.parameters()), 1e-9)


def test_every_takes_the_penalty_lazily_at_its_weight_times_the_interval():
    rule = {"params": "*", "transforms": [_gp(every=3)]}
    _steps_equal_a_hand_loop(rule, lambda t: 3 * W if t % 3 == 0 else 0, 5)


def test_a_window_takes_the_penalty_only_inside_it():
    rule = {"params": "*", "transforms": [_gp()], "active": {"until": 2}}
    _steps_equal_a_hand_loop(rule, lambda t: W if t < 2 else 0, 4)


def test_a_scheduled_weight_follows_the_step_clock():
    weight = {"schedule": "linear", "start": 0.1, "end": 0.4, "until": "3ba"}
    rule = {"params": "*", "transforms": [_gp(weight=weight)]}
    _steps_equal_a_hand_loop(rule, lambda t: 0.1 + 0.3 * min(t, 3) / 3, 4, total_steps=4)


def test_the_penalty_is_each_micro_batchs_own_under_a_loss_divisor():
    (x, y), (x2, y2) = batch(1), batch(2)
    model, twin = _net(), _net()
    hooks = attach(model, {"gp": {"params": "*", "transforms": [_gp()]}})
    hooks.set_loss_divisor(2)
    for xb, yb in ((x, y), (x2, y2)):
        hooks.backward(F.cross_entropy(model(xb), yb) / 2)
    for xb, yb in ((x, y), (x2, y2)):
        loss = F.cross_entropy(twin(xb), yb)
        ((loss + W * _param_term(loss, list(twin.parameters()), 2)) / 2).backward()
    _close(_grads(model), _grads(twin))


def test_sam_takes_both_passes_of_the_loss_with_its_penalty():
    x, y = batch()
    model, twin = _net(), _net()
    hooks = attach(
        model,
        {
            "gp": {"params": "*", "transforms": [_gp()]},
            "sam": {"params": "*", "transforms": [{"name": "sam", "rho": 0.05}]},
        },
    )

    def closure():
        return F.cross_entropy(model(x), y)

    hooks.backward(closure(), closure=closure)
    hooks.after_backward()
    params = list(twin.parameters())

    def penalized():
        loss = F.cross_entropy(twin(x), y)
        return loss + W * _param_term(loss, params, 2)

    g = torch.autograd.grad(penalized(), params)
    norm = torch.cat([t.flatten() for t in g]).norm()
    with torch.no_grad():
        for p, t in zip(params, g):
            p.add_(t, alpha=0.05 / float(norm))
    penalized().backward()
    with torch.no_grad():
        for p, t in zip(params, g):
            p.sub_(t, alpha=0.05 / float(norm))
    _close(_grads(model), _grads(twin), 1e-9)
    _close(list(model.parameters()), list(_net().parameters()), 0)  # the weights back bitwise


@pytest.mark.parametrize("power", [1, 2])
def test_finite_difference_equals_its_hand_loop_and_approaches_the_exact_gradient(power):
    x, y = batch()
    model, twin, exact = _net(), _net(), _net()
    r = 1e-4
    hooks = attach(
        model, {"gp": {"params": "*", "transforms": [_gp(power=power, method="finite_difference", radius=r)]}}
    )

    def closure():
        return F.cross_entropy(model(x), y)

    hooks.backward(closure(), closure=closure)
    assert hooks.forward_passes() == 2
    params = list(twin.parameters())
    g0 = torch.autograd.grad(F.cross_entropy(twin(x), y), params)
    norm = torch.cat([t.flatten() for t in g0]).norm()
    a = W * (1.0 if power == 1 else 2 * float(norm)) / r
    with torch.no_grad():
        for p, t in zip(params, g0):
            p.add_(t, alpha=r / float(norm))
    g1 = torch.autograd.grad(F.cross_entropy(twin(x), y), params)
    want = [(1 - a) * u + a * v for u, v in zip(g0, g1)]
    _close(_grads(model), want, 1e-12)
    loss = F.cross_entropy(exact(x), y)
    (loss + W * _param_term(loss, list(exact.parameters()), power)).backward()
    flat = torch.cat([g.flatten() for g in _grads(model)])
    ref = torch.cat([g.flatten() for g in _grads(exact)])
    assert float((flat - ref).norm() / ref.norm()) < 1e-3  # O(radius) from the exact penalty's gradient


def test_a_loss_backward_outside_hooks_backward_is_refused():
    x, y = batch()
    model = _net()
    attach(model, {"gp": {"params": "*", "transforms": [_gp()]}})
    with pytest.raises(RuntimeError, match=r"hooks\.gp: a penalty rule adds its term in hooks\.backward"):
        F.cross_entropy(model(x), y).backward()


@pytest.mark.parametrize(
    ("rule", "words"),
    [
        ({"params": "*", "transforms": [_gp(weight=-1.0)]}, r"weight=-1\.0 must be a number >= 0"),
        ({"params": "*", "transforms": [_gp(every=0)]}, r"every=0 must be an int >= 1"),
        ({"params": "*", "transforms": [_gp(power=3)]}, r"power=3; allowed: 1 .* or 2"),
        ({"params": "*", "transforms": [_gp(method="newton")]}, r"method='newton'; allowed: exact, finite_difference"),
        ({"params": "nope.*", "transforms": [_gp()]}, r"hooks\.r\.params: 'nope\.\*' matches no parameter"),
        ({"modules": "fc1", "transforms": [_gp()]}, r"grad_penalty takes the loss's gradient on parameters"),
        ({"params": "*", "transforms": [_ip()]}, r"input_grad_penalty on a module's input \(give modules"),
        ({"params": "@input", "transforms": [_gp()]}, r"@input is the model itself .* for a modules rule"),
        ({"modules": "@input", "transforms": [{"name": "clamp", "bound": 1.0}]}, r"@input .* is for a penalty rule"),
        (
            {"params": "*", "transforms": [_gp(), {"name": "clamp", "bound": 1.0}]},
            r"'clamp' cannot run at stage 'penalty'",
        ),
    ],
)
def test_bad_penalty_rules_are_one_line(rule, words):
    with pytest.raises(ValueError, match=words):
        attach(_net(), {"r": rule})


@pytest.mark.parametrize(
    ("other", "words"),
    [
        ({"params": "*", "transforms": [{"name": "per_sample_clip", "max_norm": 1.0}]}, r"splits it into examples"),
        ({"params": "*", "transforms": ["pcgrad"]}, r"splits it into tasks"),
    ],
)
def test_a_penalty_beside_a_rule_that_splits_the_loss_is_one_line(other, words):
    with pytest.raises(ValueError, match=r"hooks\.gp: a penalty rule takes the gradient of the whole loss.*" + words):
        attach(_net(), {"gp": {"params": "*", "transforms": [_gp()]}, "o": other})


def test_finite_difference_beside_sam_is_one_line():
    with pytest.raises(ValueError, match=r"finite_difference runs a second forward .* use method: exact"):
        attach(
            _net(),
            {
                "gp": {"params": "*", "transforms": [_gp(method="finite_difference")]},
                "sam": {"params": "*", "transforms": [{"name": "sam", "rho": 0.05}]},
            },
        )
