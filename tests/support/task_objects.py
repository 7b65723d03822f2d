"""Objects of a user's own for the tests of tasks beyond classification (``_target_`` paths)."""

from __future__ import annotations

import torch
from torch import nn

W = torch.tensor([[1.5], [-2.0], [0.5], [1.0]])  # the regression's true weights


def regression(n_train: int = 200, n_test: int = 50, noise: float = 0.1):
    """(train, test) pairs of 4 features and one float target each: y = x @ W + 1 + noise."""
    g = torch.Generator().manual_seed(3)

    def part(n):
        x = torch.randn(n, 4, generator=g)
        return x, x @ W + 1.0 + noise * torch.randn(n, 1, generator=g)

    return part(n_train), part(n_test)


def two_targets(n_train: int = 120, n_test: int = 40):
    """Classification and regression on the same inputs: labels ``{"cls": ..., "reg": ...}``."""
    g = torch.Generator().manual_seed(4)

    def part(n):
        x = torch.randn(n, 4, generator=g)
        return x, {"cls": (x[:, 0] > 0).long(), "reg": x[:, 1:2] * 2.0}

    return part(n_train), part(n_test)


def two_targets_few_labelled(n_train: int = 120, n_test: int = 40, labelled: int = 4):
    """``two_targets`` with the ``cls`` label of all but ``labelled`` training examples -100
    (none): batches of 20 then hold at least two without any ``cls`` label."""
    (x, y), test = two_targets(n_train, n_test)
    y["cls"][labelled:] = -100
    return (x, y), test


class TwoHeads(nn.Module):
    """A shared Linear trunk with heads ``cls`` (2 logits) and ``reg`` (one number), as a tuple."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(4, 16), nn.Tanh())
        self.cls, self.reg = nn.Linear(16, 2), nn.Linear(16, 1)

    def forward(self, x):
        h = self.trunk(x)
        return self.cls(h), self.reg(h)


def cls_and_reg(outputs, labels):
    """A loss of the user's own over the whole outputs: named losses of different kinds."""
    logits, value = outputs
    return {
        "cls": nn.functional.cross_entropy(logits, labels["cls"]),
        "reg": nn.functional.mse_loss(value, labels["reg"]),
    }


def mean_abs_error(output, target):
    return (output - target).abs().mean()


class RegNanAt:
    """``cls_and_reg`` with the ``reg`` loss nan at call ``at``: one task's nan, the other fine."""

    def __init__(self, at: int = 3):
        self.at, self.calls = at, 0

    def __call__(self, outputs, labels):
        self.calls += 1
        losses = cls_and_reg(outputs, labels)
        if self.calls == self.at:
            losses["reg"] = losses["reg"] * float("nan")
        return losses
