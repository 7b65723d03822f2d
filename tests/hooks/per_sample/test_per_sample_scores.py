"""The ``scores`` transform: each example's gradient norm (GraNd) and error norm (EL2N) by dataset
index, against torch.func's per-example gradients and a hand-built EL2N."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

from gradmod.hooks import attach
from gradmod.models import MnistCNN

SCORES = {"s": {"params": "*", "stage": "per_sample", "transforms": ["scores"]}}


def _mixed() -> nn.Module:
    """Conv, GroupNorm, a Linear over each example's 24 rows and a plain Linear head."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(1, 4, 3, padding=1)
            self.norm = nn.GroupNorm(2, 4)
            self.rows = nn.Linear(6, 5)
            self.head = nn.Linear(24 * 5, 3)

        def forward(self, x):
            h = F.relu(self.norm(self.conv(x)))  # [B, 4, 6, 6]
            h = self.rows(h.reshape(len(x), 24, 6))  # [B, 24, 5]
            return self.head(h.flatten(1))

    return Net()


def _vmap_norms(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, xi, yi):
        return F.cross_entropy(functional_call(model, p, (xi[None],)), yi[None])

    g = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
    return torch.stack([v.reshape(len(x), -1).square().sum(1) for v in g.values()]).sum(0).sqrt()


def _el2n(output: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (output.softmax(1) - F.one_hot(y, output.shape[1]).to(output.dtype)).norm(dim=1)


@pytest.mark.parametrize("build,shape", [(MnistCNN, (1, 28, 28)), (_mixed, (1, 6, 6))])
def test_grand_equals_vmap_norms_and_el2n_the_error_norm_in_float64(build, shape):
    torch.manual_seed(0)
    model = build().double()
    hooks = attach(model, SCORES)
    stage = hooks.stage("per_sample")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    for step in range(3):  # the first backward checks against autograd, the later ones probe
        x, y = torch.randn(7, *shape, dtype=torch.float64), torch.randint(0, 3, (7,))
        index = torch.arange(7) * 10 + step
        reference = (_vmap_norms(model, x, y), _el2n(model(x).detach(), y))
        stage.see_batch(index, y)
        out = model(x)
        F.cross_entropy(out, y).backward()
        hooks.after_backward()
        opt.step()
        opt.zero_grad()
        seen.append((index, y, *reference))
    rows = stage.take_scores()
    assert rows["index"].tolist() == torch.cat([s[0] for s in seen]).tolist()
    assert rows["label"].tolist() == torch.cat([s[1] for s in seen]).tolist()
    assert rows["grand"].dtype == torch.float64
    torch.testing.assert_close(rows["grand"], torch.cat([s[2] for s in seen]), rtol=0, atol=1e-6)
    torch.testing.assert_close(rows["el2n"], torch.cat([s[3] for s in seen]), rtol=0, atol=1e-6)
    assert stage.take_scores()["index"].numel() == 0  # taken: a fresh start
    hooks.remove()


def test_scores_leave_the_gradient_as_autograd_gives_it():
    torch.manual_seed(0)
    model = MnistCNN()
    twin = MnistCNN()
    twin.load_state_dict(model.state_dict())
    hooks = attach(model, SCORES)
    x, y = torch.randn(5, 1, 28, 28), torch.randint(0, 10, (5,))
    for _ in range(2):
        hooks.stage("per_sample").see_batch(torch.arange(5), y)
        F.cross_entropy(model(x), y).backward()
        hooks.after_backward()
    F.cross_entropy(twin(x), y).backward()
    F.cross_entropy(twin(x), y).backward()
    for (n, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=n)


def test_scores_beside_clipping_keep_the_unclipped_norms():
    torch.manual_seed(0)
    model = MnistCNN().double()
    rule = {
        "params": "*",
        "stage": "per_sample",
        "transforms": ["scores", {"name": "per_sample_clip", "max_norm": 0.1}],
    }
    hooks = attach(model, {"dp": rule})
    x, y = torch.randn(4, 1, 28, 28, dtype=torch.float64), torch.randint(0, 10, (4,))
    expected = _vmap_norms(model, x, y)
    hooks.stage("per_sample").see_batch(torch.arange(4), y)
    F.cross_entropy(model(x), y).backward()
    hooks.after_backward()
    torch.testing.assert_close(hooks.stage("per_sample").take_scores()["grand"], expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("layer", ["conv2", "l1"], ids=["per_example_weights", "closed_form_norm"])
def test_a_use_outside_the_followed_calls_from_a_later_step_is_refused(layer):
    """After the first backward every one is checked along the probe directions, the layers whose
    per-example weights are formed (the MNIST CNN's convolutions) too: GraNd is never silently short."""
    torch.manual_seed(0)
    model = MnistCNN()
    hooks = attach(model, SCORES)
    for step in range(3):
        x, y = torch.randn(6, 1, 28, 28), torch.randint(0, 10, (6,))
        hooks.stage("per_sample").see_batch(torch.arange(6), y)
        loss = F.cross_entropy(model(x), y)
        if step == 2:  # the weight in the loss too, outside every module call
            loss = loss + getattr(model, layer).weight.square().sum()
        if step < 2:
            loss.backward()
            hooks.after_backward()
            continue
        with pytest.raises(ValueError, match=f"'{layer}.weight' got part of its gradient outside"):
            loss.backward()
            hooks.after_backward()
    hooks.remove()


def test_a_backward_without_the_batch_indices_is_one_line():
    model = MnistCNN()
    hooks = attach(model, SCORES)
    y = torch.randint(0, 10, (3,))
    with pytest.raises(ValueError, match=r"without their dataset indices; call hooks.stage\('per_sample'\).see_batch"):
        F.cross_entropy(model(torch.randn(3, 1, 28, 28)), y).backward()
    hooks.stage("per_sample").see_batch(torch.arange(4), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="see_batch named 4 examples, the backward had 3"):
        F.cross_entropy(model(torch.randn(3, 1, 28, 28)), y).backward()


@pytest.mark.parametrize(
    "index,target,match",
    [
        (
            torch.arange(3.0),
            torch.zeros(3, dtype=torch.long),
            r"index must be a 1-d integer tensor \(one per example\); got a 1-d torch.float32",
        ),
        (
            torch.arange(3),
            torch.zeros(3, 2, dtype=torch.long),
            r"target must be a 1-d integer tensor \(one per example\); got a 2-d",
        ),
        (torch.arange(3), torch.zeros(2, dtype=torch.long), "got 3 indices and 2 labels"),
    ],
)
def test_see_batch_refuses_what_is_no_index_or_label(index, target, match):
    hooks = attach(MnistCNN(), SCORES)
    with pytest.raises(ValueError, match=match):
        hooks.stage("per_sample").see_batch(index, target)


def test_an_output_that_is_no_logits_matrix_is_refused():
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(4, 3)

        def forward(self, x):
            return {"a": self.l(x)}

    model = Two()
    hooks = attach(model, SCORES)
    hooks.stage("per_sample").see_batch(torch.arange(2), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"EL2N needs the model's output as one \[batch, classes\] tensor"):
        model(torch.randn(2, 4))


def test_two_rules_keeping_scores_are_refused():
    rules = {
        "a": {"params": "conv*", "stage": "per_sample", "transforms": ["scores"]},
        "b": {"params": "l1.*", "stage": "per_sample", "transforms": ["scores"]},
    }
    with pytest.raises(ValueError, match="per_sample rules a, b both keep scores; one rule may"):
        attach(MnistCNN(), rules)


def test_see_batch_without_a_scores_rule_is_refused():
    hooks = attach(MnistCNN(), {"c": {"params": "*", "stage": "per_sample", "transforms": ["log"]}})
    assert not hooks.stage("per_sample").keeps_scores
    with pytest.raises(ValueError, match=r"no per_sample rule keeps scores \(transforms: \[scores\]\)"):
        hooks.stage("per_sample").see_batch(torch.arange(2), torch.arange(2))


def test_pending_rows_travel_in_the_state_dict():
    model = MnistCNN()
    hooks = attach(model, SCORES)
    y = torch.randint(0, 10, (3,))
    hooks.stage("per_sample").see_batch(torch.tensor([5, 9, 2]), y)
    F.cross_entropy(model(torch.randn(3, 1, 28, 28)), y).backward()
    hooks.after_backward()
    state = hooks.state_dict()
    again = attach(MnistCNN(), SCORES)
    again.load_state_dict(state)
    assert again.stage("per_sample").take_scores()["index"].tolist() == [5, 9, 2]
