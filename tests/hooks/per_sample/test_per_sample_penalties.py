"""per_sample rules and a loss that takes a gradient of itself (``torch.autograd.grad`` inside the
loss). Differentiated again (``create_graph=True``: a gradient penalty) through a rule's layers,
the penalty's gradient reaches the weights through that backward, which no layer input times
output gradient gives: refused in one line as the penalty is taken, on the first step or a later
one. Taken without a graph (a norm read for logging), it is torch's, and the step is as without it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from penalties import PENALTIES, Net, batch

from gradmod.hooks import attach

RULES = {
    "dp": {
        "dp": {"params": "*", "transforms": [{"name": "per_sample_clip", "max_norm": 1.0, "noise_multiplier": 1.1}]}
    },
    "clip": {"clip": {"params": "*", "transforms": [{"name": "per_sample_clip", "max_norm": 0.5}]}},
    "scores": {"scores": {"params": "*", "stage": "per_sample", "transforms": ["scores"]}},
}


def _net() -> Net:
    torch.manual_seed(0)
    return Net().double()


def _step(hooks, model, x, y, loss_fn) -> None:
    if hooks.keeping_scores is not None:
        hooks.keeping_scores.see_batch(torch.arange(len(y)), y)
    loss_fn(model, x, y).backward()
    hooks.after_backward()
    model.zero_grad()


def _plain(model, x, y):
    return F.cross_entropy(model(x), y)


@pytest.mark.parametrize("kind", sorted(PENALTIES))
@pytest.mark.parametrize("rule", sorted(RULES))
@pytest.mark.parametrize("from_step", [0, 1])
def test_a_penalty_through_the_rules_layers_is_one_line(rule, kind, from_step):
    """From the first step, or from a later one where the stage runs its weights detached."""
    if from_step and kind == "param" and rule != "scores":
        pytest.skip("a clipped weight runs detached after the first step: torch refuses its gradient itself")
    model, (x, y) = _net(), batch()
    hooks = attach(model, RULES[rule])
    for _ in range(from_step):
        _step(hooks, model, x, y, _plain)
    with pytest.raises(ValueError) as err:
        _step(hooks, model, x, y, PENALTIES[kind])
    line = str(err.value)
    assert "\n" not in line and line.startswith("per_sample: the loss takes a gradient of itself")
    assert f"hooks.{rule}" in line and "create_graph=True" in line
    hooks.remove()


def test_a_penalty_on_a_detached_clipped_weight_is_refused_by_torch():
    """After the first step a clipped weight runs detached (autograd computes no batch gradient of
    it): a gradient of it is refused by torch itself, as for any tensor outside the graph."""
    model, (x, y) = _net(), batch()
    hooks = attach(model, RULES["clip"])
    _step(hooks, model, x, y, _plain)
    with pytest.raises(RuntimeError, match="appears to not have been used in the graph"):
        _step(hooks, model, x, y, PENALTIES["param"])
    hooks.remove()


def _reading(model, x, y):
    """The loss, with its gradient of the input read on the way (no graph): a norm to log."""
    x = x.detach().requires_grad_()
    loss = F.cross_entropy(model(x), y)
    (gx,) = torch.autograd.grad(loss, x, retain_graph=True)
    assert torch.isfinite(gx).all()
    return loss


@pytest.mark.parametrize("rule", sorted(RULES))
def test_a_gradient_read_without_a_graph_leaves_the_step_as_without_it(rule):
    """Three steps (the later ones on detached weights): the same .grad and scores, bit for bit."""
    out = {}
    for loss_fn in (_plain, _reading):
        model, (x, y) = _net(), batch()
        hooks = attach(model, RULES[rule])
        torch.manual_seed(5)  # the noise
        grads = []
        for _ in range(3):
            if hooks.keeping_scores is not None:
                hooks.keeping_scores.see_batch(torch.arange(len(y)), y)
            loss_fn(model, x, y).backward()
            hooks.after_backward()
            grads.append([p.grad.clone() for p in model.parameters()])
            model.zero_grad()
        scores = hooks.keeping_scores.take_scores() if hooks.keeping_scores is not None else {}
        out[loss_fn] = grads, scores
        hooks.remove()
    (plain, plain_scores), (read, read_scores) = out[_plain], out[_reading]
    assert all(torch.equal(a, b) for s, t in zip(plain, read) for a, b in zip(s, t))
    assert plain_scores.keys() == read_scores.keys()
    assert all(torch.equal(plain_scores[k], read_scores[k]) for k in plain_scores)
