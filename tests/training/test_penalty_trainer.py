"""The Trainer with a loss that takes a gradient of itself (a gradient penalty): a hook rule acts on
the gradient of the whole loss, the penalty computed from torch's gradient; a per_sample rule is one
line at the first step, but for the shipped input_grad_penalty, which DP-SGD clips per example
(float64, against a hand-written step and ``torch.func``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from penalties import Net, batch, per_example_input_penalty
from user_objects import ParamPenaltyLoss

from gradmod.hooks import attach
from gradmod.training.callbacks import Callback
from gradmod.training.trainer import Trainer, TrainerSettings

BOUND = 0.02


class _Grads(Callback):
    def __init__(self):
        self.seen = []

    def on_before_optimizer_step(self, trainer) -> bool:
        self.seen.append([p.grad.clone() for p in trainer.model.parameters()])
        return False


def _net() -> Net:
    torch.manual_seed(0)
    return Net().double()


def _trainer(model, hooks, callbacks=()) -> Trainer:
    return Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        TrainerSettings(batch_size=16, log_every=2**62),
        hooks=hooks,
        callbacks=list(callbacks),
        loss_fn=ParamPenaltyLoss(lam=0.3),
        generator=torch.Generator().manual_seed(7),
    )


def test_a_hook_rule_clamps_the_gradient_of_the_loss_with_its_penalty():
    x, y = batch()
    twin = _net()
    ce = F.cross_entropy(twin(x), y)
    grads = torch.autograd.grad(ce, list(twin.parameters()), create_graph=True)
    total = ce + 0.3 * sum(g.square().sum() for g in grads)
    raw = torch.autograd.grad(total, list(twin.parameters()))
    want = [g.clamp(-BOUND, BOUND) if n.startswith("fc1.") else g for (n, _), g in zip(twin.named_parameters(), raw)]
    model, seen = _net(), _Grads()
    hooks = attach(model, {"c": {"params": "fc1.*", "transforms": [{"name": "clamp", "bound": BOUND}]}})
    _trainer(model, hooks, [seen]).train_epoch(x, y)  # one batch: one step
    hooks.remove()
    (got,) = seen.seen
    assert max(float((a - b).abs().max()) for a, b in zip(got, want)) <= 1e-6
    assert max(float((a - b).abs().max()) for a, b in zip(want, raw)) > 1e-3  # the clamp bites


@pytest.mark.parametrize("rule", ["dp", "scores"])
def test_a_per_sample_rule_with_a_penalty_is_one_line_at_the_first_step(rule):
    rules = {
        "dp": {"dp": {"params": "*", "transforms": [{"name": "per_sample_clip", "max_norm": 1.0}]}},
        "scores": {"scores": {"params": "*", "stage": "per_sample", "transforms": ["scores"]}},
    }[rule]
    model = _net()
    hooks = attach(model, rules)
    trainer = _trainer(model, hooks)
    with pytest.raises(ValueError) as err:
        trainer.train_epoch(*batch())
    line = str(err.value)
    assert "\n" not in line and line.startswith("per_sample: the loss takes a gradient of itself")
    assert trainer.step == 0
    hooks.remove()


def _micro_batches(model, hooks, seen) -> Trainer:
    """Two micro-batches of 8 a step, the examples shuffled by seed 7."""
    return Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        TrainerSettings(batch_size=8, accumulate=2, log_every=2**62),
        hooks=hooks,
        callbacks=[seen],
        loss_fn=F.cross_entropy,
        generator=torch.Generator().manual_seed(7),
    )


@pytest.mark.parametrize("rule", ["grad_penalty", "input_grad_penalty"])
def test_a_shipped_penalty_under_accumulation_is_each_micro_batchs_own(rule):
    """Two micro-batches of 8 make one step: each one's loss with its own penalty, halved."""
    x, y = batch()
    spec = {
        "grad_penalty": {"params": "fc1.*", "transforms": [{"name": "grad_penalty", "weight": 0.3}]},
        "input_grad_penalty": {"modules": "@input", "transforms": [{"name": "input_grad_penalty", "weight": 0.3}]},
    }[rule]
    model, seen = _net(), _Grads()
    hooks = attach(model, {"p": spec})
    _micro_batches(model, hooks, seen).train_epoch(x, y)
    hooks.remove()
    order = torch.randperm(16, generator=torch.Generator().manual_seed(7))  # the trainer's shuffle
    twin = _net()
    for part in (order[:8], order[8:]):
        xb, yb = x[part], y[part]
        if rule == "input_grad_penalty":
            xb = xb.clone().requires_grad_()
        loss = F.cross_entropy(twin(xb), yb)
        wrt = list(twin.fc1.parameters()) if rule == "grad_penalty" else [xb]
        grads = torch.autograd.grad(loss, wrt, create_graph=True)
        if rule == "grad_penalty":
            term = sum(g.square().sum() for g in grads)
        else:
            term = (8 * grads[0]).square().sum(1).mean()  # each example's own loss's input gradient
        ((loss + 0.3 * term) / 2).backward()
    (got,) = seen.seen
    want = [p.grad for p in twin.parameters()]
    assert max(float((a - b).abs().max()) for a, b in zip(got, want)) <= 1e-10


def test_dp_with_the_input_penalty_under_accumulation_clips_each_examples_penalized_gradient():
    """Two micro-batches of 8, one step: every example's gradient of its own penalized loss
    (``torch.func``), clipped, summed over both and divided by the 16 examples."""
    x, y = batch()
    rules = {
        "p": {"modules": "@input", "transforms": [{"name": "input_grad_penalty", "weight": 0.3}]},
        "dp": {"params": "*", "transforms": [{"name": "per_sample_clip", "max_norm": 0.5}]},
    }
    model, seen = _net(), _Grads()
    hooks = attach(model, rules)
    _micro_batches(model, hooks, seen).train_epoch(x, y)
    hooks.remove()
    per = per_example_input_penalty(_net(), x, y, 0.3)  # (the order of the examples does not matter)
    norms = torch.cat([g.flatten(1) for g in per.values()], 1).norm(dim=1)
    factor = (0.5 / (norms + 1e-6)).clamp(max=1.0)
    assert bool((norms > 0.5).any())  # the clip bites
    want = [torch.tensordot(factor, per[n], 1) / 16 for n, _ in model.named_parameters()]
    (got,) = seen.seen
    assert max(float((a - b).abs().max()) for a, b in zip(got, want)) <= 1e-10
