"""The Trainer with a loss that takes a gradient of itself (a gradient penalty): a hook rule acts on
the gradient of the whole loss, the penalty computed from torch's gradient; a per_sample rule is one
line at the first step (float64, against a hand-written step)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from penalties import Net, batch
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
