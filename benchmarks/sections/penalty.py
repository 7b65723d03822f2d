"""The ``penalty`` section of ``python -m benchmarks``: the shipped penalty rules against the same
penalty written by hand, and against a plain step (Adam, one thread):

    plain       forward, cross-entropy, loss.backward(), step
    hand_gp     loss + w ||dL/dtheta||^2 by hand: autograd.grad(create_graph=True), then backward
    grad_penalty    attach(model, {grad_penalty on "*"}), hooks.backward(loss), after_backward, step
    hand_ip     loss + w mean_i ||d l_i / d x_i||^2 by hand: the input made to take a gradient
    input_grad_penalty  attach(model, {input_grad_penalty on @input}), the same loop

Models: ``mlp`` (784-1024-1024-10, ReLU; batch 64) and ``mnist`` (gradmod's MNIST CNN; batch 100).
The rules do what the hand loops do, so the target is <= 1.05x their step; the penalty's own
cost (a double backward) is the ratio to the plain step, stated, not a target.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from gradmod.hooks import attach
from gradmod.models import MnistCNN

STEPS = 4  # optimizer steps per timed run
W = 0.01
MODELS = {
    "mlp": (
        lambda: nn.Sequential(
            nn.Flatten(), nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)
        ),
        64,
    ),
    "mnist": (MnistCNN, 100),
}
CONTENDERS = ("plain", "hand_gp", "grad_penalty", "hand_ip", "input_grad_penalty")
PAIRS = (("grad_penalty", "hand_gp"), ("input_grad_penalty", "hand_ip"))  # each rule and its hand-written loop
RULES = {
    "grad_penalty": {"gp": {"params": "*", "transforms": [{"name": "grad_penalty", "weight": W}]}},
    "input_grad_penalty": {"ip": {"modules": "@input", "transforms": [{"name": "input_grad_penalty", "weight": W}]}},
}


def names() -> list[str]:
    return [f"{m}.{c}" for m in MODELS for c in CONTENDERS]


def _hand(model: nn.Module, contender: str) -> Callable[[torch.Tensor, torch.Tensor], None]:
    params = [p for p in model.parameters() if p.requires_grad]

    def step(x, y):
        if contender == "hand_ip":
            x = x.detach().requires_grad_()
        loss = F.cross_entropy(model(x), y)
        if contender == "plain":
            loss.backward()
            return
        if contender == "hand_gp":
            grads = torch.autograd.grad(loss, params, create_graph=True)
            term = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).square()
        else:
            (g,) = torch.autograd.grad(loss, x, create_graph=True)
            term = (len(x) * g).flatten(1).square().sum(1).mean()  # each example's own loss's gradient
        (loss + W * term).backward()

    return step


def setup(name: str, steps: int = STEPS, device: str = "cpu") -> Callable[[], None]:
    """Build the contender (untimed) and return its timed run of ``steps`` optimizer steps."""
    model_name, contender = name.split(".")
    build, batch = MODELS[model_name]
    torch.manual_seed(0)
    model = build().to(device)
    gen = torch.Generator().manual_seed(1)
    data = [
        (
            torch.randn(batch, 1, 28, 28, generator=gen).to(device),
            torch.randint(0, 10, (batch,), generator=gen).to(device),
        )
        for _ in range(steps)
    ]
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    hooks = attach(model, RULES[contender]) if contender in RULES else None
    hand = _hand(model, contender) if hooks is None else None

    def run():
        for x, y in data:
            opt.zero_grad(set_to_none=True)
            if hooks is not None:
                hooks.backward(F.cross_entropy(model(x), y))
                hooks.after_backward()
            else:
                hand(x, y)
            opt.step()

    return run
