"""The ``penalty`` section of ``python -m benchmarks``: the shipped penalty rules against the same
penalty written by hand, and against a plain step (Adam, one thread):

    plain       forward, cross-entropy, loss.backward(), step
    hand_gp     loss + w ||dL/dtheta||^2 by hand: autograd.grad(create_graph=True), then backward
    grad_penalty    attach(model, {grad_penalty on "*"}), hooks.backward(loss), after_backward, step
    hand_ip     loss + w mean_i ||d l_i / d x_i||^2 by hand: the input made to take a gradient
    input_grad_penalty  attach(model, {input_grad_penalty on @input}), the same loop
    dp          attach(model, {per_sample_clip with noise on "*"}): DP-SGD without a penalty
    func_dp_ip  DP-SGD of each example's own penalized loss by torch.func: vmap over grad, clip, sum, noise
    dp_input_grad_penalty  attach(model, {input_grad_penalty, per_sample_clip with noise}), the same step

Models: ``mlp`` (784-1024-1024-10, ReLU; batch 64) and ``mnist`` (gradmod's MNIST CNN; batch 100).
The rules do what the hand loops do, so the target is <= 1.05x their step; the penalty's own
cost (a double backward) is the ratio to the plain step, stated, not a target. DP-SGD with the
penalty has no peer that offers it (Opacus refuses a double backward): its reference is the
``torch.func`` step, and its cost over DP-SGD alone is stated.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

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
CONTENDERS = (
    "plain",
    "hand_gp",
    "grad_penalty",
    "hand_ip",
    "input_grad_penalty",
    "dp",
    "func_dp_ip",
    "dp_input_grad_penalty",
)
PAIRS = (("grad_penalty", "hand_gp"), ("input_grad_penalty", "hand_ip"))  # each rule and its hand-written loop
DP_PAIRS = (("dp_input_grad_penalty", "func_dp_ip"), ("dp_input_grad_penalty", "dp"))  # stated, no target
CLIP, SIGMA = 1.0, 1.0
_IP = {"ip": {"modules": "@input", "transforms": [{"name": "input_grad_penalty", "weight": W}]}}
_DP = {"dp": {"params": "*", "transforms": [{"name": "per_sample_clip", "max_norm": CLIP, "noise_multiplier": SIGMA}]}}
RULES = {
    "grad_penalty": {"gp": {"params": "*", "transforms": [{"name": "grad_penalty", "weight": W}]}},
    "input_grad_penalty": _IP,
    "dp": _DP,
    "dp_input_grad_penalty": {**_IP, **_DP},
}


def names() -> list[str]:
    return [f"{m}.{c}" for m in MODELS for c in CONTENDERS]


def _func_dp(model: nn.Module) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """One DP-SGD step of each example's ``loss_i + W ||d loss_i / d x_i||^2`` by ``torch.func``."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]

    def penalized(ps, xi, yi):
        loss_of = lambda inp: F.cross_entropy(functional_call(model, ps, (inp[None],)), yi[None])  # noqa: E731
        return loss_of(xi) + W * grad(loss_of)(xi).square().sum()

    per_example = vmap(grad(penalized), in_dims=(None, 0, 0))

    def step(x, y):
        params = {n: p.detach() for n, p in model.named_parameters() if n in names}
        per = per_example(params, x, y)
        norms = torch.linalg.vector_norm(torch.stack([g.flatten(1).norm(dim=1) for g in per.values()]), dim=0)
        factor = (CLIP / (norms + 1e-6)).clamp(max=1.0)
        for n, p in model.named_parameters():
            if n in per:
                g = torch.tensordot(factor, per[n], 1)
                p.grad = g.add_(torch.randn_like(g), alpha=SIGMA * CLIP).div_(len(x))

    return step


def _hand(model: nn.Module, contender: str) -> Callable[[torch.Tensor, torch.Tensor], None]:
    if contender == "func_dp_ip":
        return _func_dp(model)
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
