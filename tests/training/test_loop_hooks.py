"""What the Trainer asks of its hooks (``gradmod.training.loop_hooks``): a ``HookSet`` answers
all of it; an object of one's own with the core alone (backward, after_backward, the
statistics) trains as without stages: one forward a micro-batch, ``backward(losses)`` with no
closure, nothing set up, no scores."""

from __future__ import annotations

import torch
from torch import nn

from gradmod.hooks import attach, stages
from gradmod.training.loop_hooks import StagedHooks
from gradmod.training.trainer import Trainer, TrainerSettings

HALVE = {"h": {"params": "*", "stage": "fused", "transforms": [{"name": "scale", "factor": 0.5}]}}
SCORES = {"s": {"params": "*", "stage": "per_sample", "transforms": ["scores"]}}


class Halving:
    """Hooks of one's own: the core a Trainer asks of any hooks, no stages; each optimizer
    step's gradient halved before the step, as ``HALVE`` does."""

    needs_after_backward = True

    def __init__(self, model: nn.Module):
        self.model, self.calls = model, []

    def backward(self, losses: torch.Tensor) -> None:  # no closure: a Trainer hands these hooks none
        self.calls.append("backward")
        losses.backward()

    def after_backward(self) -> bool:
        self.calls.append("after_backward")
        torch._foreach_mul_([p.grad for p in self.model.parameters()], 0.5)
        return False

    def read_stats(self) -> dict:
        return {}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(24, 4, generator=g), torch.randint(0, 3, (24,), generator=g)


def _trainer(model: nn.Module, hooks, **settings) -> Trainer:
    return Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        TrainerSettings(log_every=2, **settings),
        hooks=hooks,
        generator=torch.Generator().manual_seed(5),
    )


def test_hooks_of_ones_own_without_stages_train_as_a_hookset_with_the_same_rule():
    x, y = _data()
    own_model, set_model = _model(), _model()
    own = Halving(own_model)
    assert not isinstance(own, StagedHooks)
    ours = _trainer(own_model, own, batch_size=4, accumulate=2)
    assert ours.staged is None and ours.scores is None and ours.after_step is None
    ours.train_epoch(x, y)
    assert own.calls == ["backward", "backward", "after_backward"] * 3
    hooks = attach(set_model, HALVE)
    theirs = _trainer(set_model, hooks, batch_size=4, accumulate=2)
    theirs.train_epoch(x, y)
    for p, q in zip(own_model.parameters(), set_model.parameters()):
        assert torch.equal(p, q)


def test_a_hookset_answers_what_the_trainer_asks():
    model = _model()
    hooks = attach(model, HALVE)
    assert isinstance(hooks, StagedHooks)
    trainer = _trainer(model, hooks)
    assert trainer.staged is hooks and trainer.scores is None and trainer.after_step is None
    assert trainer.stage_sync.stages == hooks.stages
    other = _model()
    scored = attach(other, SCORES)
    trainer = _trainer(other, scored)
    assert trainer.scores is scored.keeping_scores is scored.stage(stages.keeping_scores())
