"""A per_loss method's kind is its base class: a subclass of each base, and one of ``Method``
itself naming its base with ``kind``, each runs as that kind; one whose ``kind`` names
another base is refused in one line."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradmod
from gradmod.hooks import registry
from gradmod.hooks.per_loss.methods.bases import Aggregator, GramianWeighting, LossWeighting


class Shared(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Sequential(nn.Linear(6, 8), nn.Tanh())
        self.heads = nn.ModuleDict({f"t{i}": nn.Linear(8, 3) for i in range(2)})

    def forward(self, x):
        z = self.trunk(x)
        return {n: h(z) for n, h in self.heads.items()}


def _losses(model):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 6, generator=g, dtype=torch.float64)
    return {n: F.cross_entropy(o, torch.randint(0, 3, (5,), generator=g)) for n, o in model(x).items()}


class Halves(GramianWeighting):
    def weights(self, G, gen):
        return torch.full((len(G),), 0.5, dtype=G.dtype)


class FirstTask(gradmod.Method):  # on Method itself: its kind names its base
    kind = "jacobian"

    def aggregate(self, J, U):
        return J[0]


class ThreeToOne(gradmod.Method):
    kind = "losses"

    def loss_weights(self, losses, gen):
        return [3.0, 1.0]


@pytest.mark.parametrize(
    "cls, trunk_weights, base",
    [
        (Halves, (0.5, 0.5), GramianWeighting),
        (FirstTask, (1.0, 0.0), Aggregator),
        (ThreeToOne, (3.0, 1.0), LossWeighting),
    ],
)
def test_a_method_of_each_base_runs_as_its_kind(cls, trunk_weights, base):
    """The trunk's gradient is the one each base implies (by hand: the weighted sum of the
    task gradients), the heads' the plain sum's."""
    assert issubclass(cls, base) and isinstance(cls(), base)
    name = f"base_test_{cls.__name__.lower()}"
    registry.register(name, cls, kind="per_loss", overwrite=True)
    model = Shared().double()
    hooks = gradmod.attach(model, {"mtl": {"params": "trunk.*", "transforms": [name]}})
    hooks.backward(_losses(model))
    hooks.remove()
    ref = Shared().double()
    losses = list(_losses(ref).values())
    trunk, heads = list(ref.trunk.parameters()), list(ref.heads.parameters())
    per_task = [torch.autograd.grad(loss, trunk, retain_graph=True) for loss in losses]
    expected = [sum(w * g[i] for w, g in zip(trunk_weights, per_task)) for i in range(len(trunk))]
    expected += torch.autograd.grad(sum(losses), heads)
    for p, e in zip(model.parameters(), expected):
        torch.testing.assert_close(p.grad, e, rtol=1e-12, atol=1e-14)


def test_a_kind_that_names_another_base_is_refused_in_one_line():
    class Contrary(LossWeighting):
        kind = "gramian"

        def loss_weights(self, losses, gen):
            return [1.0] * len(losses)

    assert not issubclass(Contrary, GramianWeighting)
    with pytest.raises(TypeError, match="kind='gramian' names another base than Contrary's; leave kind out") as e:
        registry.register("contrary_test", Contrary, kind="per_loss")
    assert "\n" not in str(e.value) and "contrary_test" not in registry.names()
