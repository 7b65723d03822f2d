"""A gradient a loss takes of itself (``torch.autograd.grad`` inside the loss: a gradient penalty)
comes back exactly as torch gives it; the rules act on the backward that fills ``.grad``, whose
gradient then holds the penalty's gradient too. Each case in float64 against a hand-written loop
on a hook-free copy: the penalty from the raw gradient, the rule applied to the final gradient.

Three penalties: on the parameters' gradient (``||dL/dtheta||^2``), on the input's (R1's form,
``||d sum f(x) / dx||^2`` on the data) and WGAN-GP's (``(||d f(x_hat) / dx_hat|| - 1)^2`` on
interpolates of real and fake inputs)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from penalties import LAM, PENALTIES, Net, batch
from torch import nn

from gradmod.hooks import attach

TOL = 1e-6


def _net() -> nn.Module:
    torch.manual_seed(0)
    return Net().double()


def _raw(penalty, twin: nn.Module | None = None, on_fc1_output=None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(the total loss, the gradient of every parameter) on a hook-free copy; ``on_fc1_output``:
    a function on the gradient of fc1's outputs in the final backward, registered by hand after
    the penalty's own gradient was taken."""
    twin = twin or _net()
    outputs: list[torch.Tensor] = []
    handle = twin.fc1.register_forward_hook(lambda m, a, out: outputs.append(out))
    total = penalty(twin, *batch())
    handle.remove()
    if on_fc1_output is not None:
        for out in outputs:
            out.register_hook(on_fc1_output)
    params = [p for p in twin.parameters() if p.requires_grad]
    return total, list(torch.autograd.grad(total, params))


def _max_error(got: list, want: list) -> float:
    return max(float((a - b).detach().abs().max()) for a, b in zip(got, want))


def _gradmod(rules: dict, penalty, backward=None) -> tuple[nn.Module, object, torch.Tensor]:
    model = _net()
    hooks = attach(model, rules)
    total = penalty(model, *batch())
    (backward or (lambda t: t.backward()))(total)
    hooks.after_backward()
    return model, hooks, total


BOUND = 0.02
HOOK_RULES = {  # rule -> (the gradient the hand-written loop gives each parameter, its raw gradient)
    "clamp": (
        {"c": {"params": "fc1.*", "transforms": [{"name": "clamp", "bound": BOUND}]}},
        lambda name, g: g.clamp(-BOUND, BOUND) if name.startswith("fc1.") else g,
    ),
    "scale": ({"s": {"params": "*", "transforms": [{"name": "scale", "factor": 2.0}]}}, lambda name, g: 2 * g),
    "zero": ({"z": {"params": "fc2.*", "transforms": ["zero"]}}, lambda n, g: 0 * g if n.startswith("fc2.") else g),
}


@pytest.mark.parametrize("kind", sorted(PENALTIES))
@pytest.mark.parametrize("rule", sorted(HOOK_RULES))
def test_a_hook_rule_acts_on_the_final_gradient_and_the_penalty_sees_the_raw_one(rule, kind):
    rules, by_hand = HOOK_RULES[rule]
    names = [n for n, _ in _net().named_parameters()]
    total_raw, raw = _raw(PENALTIES[kind])
    want = [by_hand(n, g) for n, g in zip(names, raw)]
    model, hooks, total = _gradmod(rules, PENALTIES[kind])
    assert torch.equal(total, total_raw)  # the penalty from torch's gradient, bit for bit
    assert _max_error([p.grad for p in model.parameters()], want) <= TOL
    assert _max_error(want, raw) > 1e-3  # the rule bites
    hooks.remove()


@pytest.mark.parametrize("kind", sorted(PENALTIES))
def test_a_modules_rule_acts_on_the_outputs_gradient_of_the_final_backward_only(kind):
    bound = 1e-3  # an output's gradient is per example (the mean's 1/16 in it)
    rules = {"c": {"modules": "fc1", "transforms": [{"name": "clamp", "bound": bound}]}}
    total_raw, want = _raw(PENALTIES[kind], on_fc1_output=lambda g: g.clamp(-bound, bound))
    _, raw = _raw(PENALTIES[kind])
    model, hooks, total = _gradmod(rules, PENALTIES[kind])
    assert torch.equal(total, total_raw)
    assert _max_error([p.grad for p in model.parameters()], want) <= TOL
    assert _max_error(want, raw) > 1e-4
    hooks.remove()


@pytest.mark.parametrize("kind", sorted(PENALTIES))
def test_log_observes_the_final_gradient_once_per_backward(kind):
    rules = {"l": {"params": "*", "transforms": ["log"]}}
    _, raw = _raw(PENALTIES[kind])
    model, hooks, _ = _gradmod(rules, PENALTIES[kind])
    stats = hooks.read_stats()
    for (name, p), g in zip(model.named_parameters(), raw):
        assert stats[name]["calls"] == 1
        assert abs(stats[name]["norm"] - float(g.norm())) <= TOL * max(1.0, float(g.norm()))
        assert _max_error([p.grad], [g]) <= TOL
    hooks.remove()


def test_autograd_grad_alone_is_torchs_and_leaves_no_statistic_or_raw_gradient():
    """With or without create_graph: no transform, no ``log`` row, nothing for the non-finite count."""
    rules = {"c": {"params": "*", "transforms": ["log", {"name": "clamp", "bound": BOUND}, "log"]}}
    x, y = batch()
    twin = _net()
    want = torch.autograd.grad(F.cross_entropy(twin(x), y), list(twin.parameters()))
    model = _net()
    hooks = attach(model, rules)
    for create_graph in (False, True):
        got = torch.autograd.grad(F.cross_entropy(model(x), y), list(model.parameters()), create_graph=create_graph)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert hooks.read_stats() == {}
    assert hooks.take_raw_parts() == ([], [], set())
    assert all(p.grad is None for p in model.parameters())
    hooks.remove()


def _clip_by_total_norm(grads: list[torch.Tensor], max_norm: float) -> list[torch.Tensor]:
    norm = torch.sqrt(sum(g.square().sum() for g in grads))
    return [g * min(1.0, max_norm / (float(norm) + 1e-6)) for g in grads]


def _agc(params: list[torch.Tensor], grads: list[torch.Tensor], factor: float, eps: float) -> list[torch.Tensor]:
    """Unit-wise: each output unit's gradient norm at most ``factor * max(|w_unit|, eps)`` (a vector as a whole)."""
    out = []
    for p, g in zip(params, grads):
        dims = tuple(range(1, g.dim())) if g.dim() > 1 else None
        unit_w = p.detach().norm(dim=dims, keepdim=True) if dims else p.detach().norm()
        unit_g = g.norm(dim=dims, keepdim=True) if dims else g.norm()
        out.append(g * (factor * unit_w.clamp_min(eps) / unit_g.clamp_min(1e-6)).clamp_max(1.0))
    return out


FUSED = {
    "global_norm_clip": (
        {"c": {"params": "*", "transforms": [{"name": "global_norm_clip", "max_norm": 0.05}]}},
        lambda params, grads: _clip_by_total_norm(grads, 0.05),
    ),
    "agc": (
        {"a": {"params": "*", "stage": "fused", "transforms": [{"name": "agc", "clip_factor": 0.01, "eps": 1e-3}]}},
        lambda params, grads: _agc(params, grads, 0.01, 1e-3),
    ),
    "clamp": (
        {"c": {"params": "*", "stage": "fused", "transforms": [{"name": "clamp", "bound": BOUND}]}},
        lambda params, grads: [g.clamp(-BOUND, BOUND) for g in grads],
    ),
}


@pytest.mark.parametrize("kind", sorted(PENALTIES))
@pytest.mark.parametrize("rule", sorted(FUSED))
def test_a_fused_rule_transforms_the_accumulated_gradient_with_the_penaltys(rule, kind):
    rules, by_hand = FUSED[rule]
    twin = _net()
    total_raw, raw = _raw(PENALTIES[kind], twin)
    want = by_hand(list(twin.parameters()), raw)
    model, hooks, total = _gradmod(rules, PENALTIES[kind])
    assert torch.equal(total, total_raw)
    assert _max_error([p.grad for p in model.parameters()], want) <= TOL
    assert _max_error(want, raw) > 1e-4
    hooks.remove()


@pytest.mark.parametrize("kind", sorted(PENALTIES))
def test_freeze_takes_its_parameters_out_and_the_penalty_covers_the_rest(kind):
    """A frozen tensor takes no part (``requires_grad`` off from the forward on): the penalty is over
    the parameters that train, as by hand with ``requires_grad_(False)``; two steps of SGD."""
    rules = {"f": {"params": "fc1.*", "transforms": ["freeze"]}}
    twin = _net()
    twin.fc1.requires_grad_(False)
    model = _net()
    hooks = attach(model, rules)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(twin.parameters(), lr=0.1)
    for _ in range(2):
        _, raw = _raw(PENALTIES[kind], twin)
        for p, g in zip(twin.fc2.parameters(), raw):
            p.grad = g
        ref_opt.step()
        PENALTIES[kind](model, *batch()).backward()
        hooks.after_backward()
        assert model.fc1.weight.grad is None and model.fc1.bias.grad is None
        assert _max_error([p.grad for p in model.fc2.parameters()], raw) <= TOL
        opt.step()
        opt.zero_grad()
    assert _max_error(list(model.parameters()), list(twin.parameters())) <= TOL
    hooks.remove()


@pytest.mark.parametrize("kind", sorted(PENALTIES))
def test_sam_takes_both_passes_of_the_loss_with_its_penalty(kind):
    """SAM on the whole loss: ``g`` its raw gradient at ``w``, the gradient at ``w + rho g / |g|``."""
    rho = 0.05
    twin = _net()
    _, g = _raw(PENALTIES[kind], twin)
    norm = torch.sqrt(sum(t.square().sum() for t in g))
    with torch.no_grad():
        for p, t in zip(twin.parameters(), g):
            p.add_(rho * t / (norm + 1e-12))
    _, want = _raw(PENALTIES[kind], twin)
    rules = {"s": {"params": "*", "transforms": [{"name": "sam", "rho": rho}]}}
    start = [p.detach().clone() for p in _net().parameters()]
    penalty, xy = PENALTIES[kind], batch()
    model = _net()
    hooks = attach(model, rules)
    hooks.backward(penalty(model, *xy), closure=lambda: penalty(model, *xy))
    hooks.after_backward()
    assert _max_error([p.grad for p in model.parameters()], want) <= TOL
    assert _max_error(want, g) > 1e-4
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), start))  # moved back bitwise
    hooks.remove()


class TwoTasks(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Linear(6, 8)
        self.a, self.b = nn.Linear(8, 3), nn.Linear(8, 3)
        with torch.no_grad():  # the tasks' trunk gradients conflict
            self.b.weight.copy_(-self.a.weight)

    def forward(self, x):
        z = torch.tanh(self.trunk(x))
        return self.a(z), self.b(z)


def _task_losses(model: TwoTasks, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """Task a's loss holds a penalty on its own gradient of the trunk's parameters."""
    out_a, out_b = model(x)
    ce_a = F.cross_entropy(out_a, y)
    grads = torch.autograd.grad(ce_a, list(model.trunk.parameters()), create_graph=True)
    return {"a": ce_a + LAM * sum(g.square().sum() for g in grads), "b": F.cross_entropy(out_b, y)}


def _pcgrad(ga: torch.Tensor, gb: torch.Tensor) -> torch.Tensor:
    """Two tasks: each gradient projected off the other where they conflict; the sum."""
    pa = ga - min(0.0, float(ga @ gb)) / float(gb @ gb) * gb
    pb = gb - min(0.0, float(gb @ ga)) / float(ga @ ga) * ga
    return pa + pb


def test_a_penalty_inside_one_tasks_loss_enters_that_tasks_gradient():
    """per_loss pcgrad on the trunk: each task's gradient of its whole loss (task a's with its
    penalty's), projected by hand; the heads get the gradient of the sum."""
    x, y = batch()
    twin = TwoTasks().double()
    losses = _task_losses(twin, x, y)
    trunk, heads = list(twin.trunk.parameters()), [*twin.a.parameters(), *twin.b.parameters()]
    flat = [
        torch.cat([g.flatten() for g in torch.autograd.grad(loss, trunk, retain_graph=True)])
        for loss in losses.values()
    ]
    combined = _pcgrad(*flat)
    assert float(flat[0] @ flat[1]) < 0  # they conflict: the projection bites
    want = list(combined.split([p.numel() for p in trunk]))
    want = [w.view_as(p) for w, p in zip(want, trunk)] + list(torch.autograd.grad(sum(losses.values()), heads))
    model = TwoTasks().double()
    hooks = attach(model, {"pc": {"params": "trunk.*", "transforms": ["pcgrad"]}})
    hooks.backward(_task_losses(model, x, y))
    hooks.after_backward()
    got = [*model.trunk.parameters(), *model.a.parameters(), *model.b.parameters()]
    assert _max_error([p.grad for p in got], want) <= TOL
    hooks.remove()


def test_the_guides_example_runs(capsys):
    """docs/guide/penalties.md's WGAN-GP loop: one ``log`` call a step."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "guide" / "penalties.md").read_text()
    code = text.split("```python\n")[1].split("```")[0]
    exec(compile(code, "penalties.md", "exec"), {})
    assert capsys.readouterr().out.strip() == "5"


def test_a_hooked_model_deep_copies_and_a_lazy_models_parameters_are_asked_once_they_exist():
    """A stage's bound-method hooks copy with the model (as before); a lazy module's parameters,
    uninitialised at attach, are asked once they exist."""
    import copy

    model = _net()
    hooks = attach(model, {"s": {"params": "*", "stage": "per_sample", "transforms": ["scores"]}})
    copy.deepcopy(model)
    hooks.remove()
    lazy = nn.Sequential(nn.LazyLinear(4), nn.Tanh(), nn.Linear(4, 3)).double()
    hooks = attach(lazy, {"c": {"modules": "2", "transforms": [{"name": "clamp", "bound": 1e-3}]}})
    x, y = batch()
    got = {}
    for hooked in (True, False):
        loss = F.cross_entropy(lazy(x), y)
        got[hooked] = torch.autograd.grad(loss, [lazy[0].weight], retain_graph=True)[0]
        loss.backward()
        got[hooked, "grad"] = lazy[0].weight.grad
        lazy.zero_grad(set_to_none=True)
        hooks.remove()
    assert torch.equal(got[True], got[False])  # autograd.grad: torch's
    assert not torch.allclose(got[True, "grad"], got[False, "grad"])  # the backward: clamped
