"""A user's own data, models and losses for the tests, given by ``_target_``; most are
wrong in one way, as a user's first attempt might be."""

from __future__ import annotations

import os
import signal
import time

import torch
from torch import nn
from torch.nn import functional as F


def data(
    n: int = 40,
    shape: tuple = (1, 8, 8),
    test_shape: tuple | None = None,
    dtype: str = "uint8",
    top_label: int | None = None,
    signal_name: str | None = None,
):
    """(train, test) pairs of N x shape inputs and labels 0..3; ``signal_name`` sends this
    process that signal while loading (a Ctrl-C or kill during data loading)."""
    if signal_name:
        os.kill(os.getpid(), signal.Signals["SIG" + signal_name])
        time.sleep(0.5)  # the handler runs here
    g = torch.Generator().manual_seed(0)

    def split(sizes):
        x = torch.randint(0, 255, (n, *sizes), generator=g).to(getattr(torch, dtype))
        return x, torch.arange(n) % 4

    train, test = split(tuple(shape)), split(tuple(test_shape or shape))
    if top_label is not None:
        train[1][0] = top_label
    return train, test


class Tiny(nn.Module):
    """A linear classifier of 1 x 8 x 8 inputs. ``returns``: what forward gives back
    (``tensor``, ``tuple``, ``dict``, ``nans``); ``signal_name``: sent at build time;
    ``interrupt_twice_at``: two SIGINTs during that forward call (a second Ctrl-C)."""

    def __init__(
        self,
        classes: int = 4,
        returns: str = "tensor",
        signal_name: str | None = None,
        interrupt_twice_at: int | None = None,
    ):
        if signal_name:
            os.kill(os.getpid(), signal.Signals["SIG" + signal_name])
            time.sleep(0.5)
        super().__init__()
        self.fc = nn.Linear(64, classes)
        self.returns, self.interrupt_twice_at, self.calls = returns, interrupt_twice_at, 0

    def forward(self, x):
        self.calls += 1
        if self.calls == self.interrupt_twice_at:
            for _ in range(2):
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.2)
        out = self.fc(x.flatten(1))
        if self.returns == "tuple":
            return out, out.detach()
        if self.returns == "dict":
            return {"logits": out}
        if self.returns == "nans":
            return out * float("nan")
        return out


class Nested(nn.Module):
    """Tiny behind a block whose output is a dict (a ``modules:`` rule cannot hook that)."""

    def __init__(self):
        super().__init__()
        self.block = Tiny(returns="dict")

    def forward(self, x):
        return self.block(x)["logits"]


def vector_loss(output, target):
    return F.cross_entropy(output, target, reduction="none")  # one loss per example


def detached_loss(output, target):
    return F.cross_entropy(output, target).detach()


class LossThatRaises:
    """Cross-entropy, until call ``at``, which raises the user's own ValueError."""

    def __init__(self, at: int = 3):
        self.at, self.calls = at, 0

    def __call__(self, output, target):
        self.calls += 1
        if self.calls == self.at:
            raise ValueError("loss went wrong")
        return F.cross_entropy(output, target)


class NanLossAt:
    """Cross-entropy, nan at call ``at`` (the check before training has its own loss)."""

    def __init__(self, at: int = 3):
        self.at, self.calls = at, 0

    def __call__(self, output, target):
        self.calls += 1
        loss = F.cross_entropy(output, target)
        return loss * float("nan") if self.calls == self.at else loss


class ParamPenaltyLoss:
    """Cross-entropy plus ``lam`` times the squared norm of its own gradient of the parameters
    behind the output (found from its graph): a loss that differentiates a gradient it takes of itself."""

    def __init__(self, lam: float = 0.1):
        self.lam = lam

    def __call__(self, output, target):
        ce = F.cross_entropy(output, target)
        seen, todo, params = set(), [output.grad_fn], []
        while todo:
            node = todo.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            if hasattr(node, "variable"):
                params.append(node.variable)
            todo += [n for n, _ in node.next_functions]
        grads = torch.autograd.grad(ce, params, create_graph=True)
        return ce + self.lam * sum(g.square().sum() for g in grads)


class OutputPenaltyLoss:
    """Cross-entropy plus ``lam`` times the squared norm of its gradient of the output alone
    (differentiated again, yet never into the model)."""

    def __init__(self, lam: float = 0.1):
        self.lam = lam

    def __call__(self, output, target):
        ce = F.cross_entropy(output, target)
        (g,) = torch.autograd.grad(ce, output, create_graph=True)
        return ce + self.lam * g.square().sum()
