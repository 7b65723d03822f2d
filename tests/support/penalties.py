"""Losses that take a gradient of themselves (gradient penalties), and the small model they train,
for the tests of what the rules do with them (float64)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

LAM = 0.3


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return 3 * torch.randn(16, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (16,), generator=g)


def param_penalty(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``L + lam ||dL/dtheta||^2`` over the parameters that train."""
    loss = F.cross_entropy(model(x), y)
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, params, create_graph=True)
    return loss + LAM * sum(g.square().sum() for g in grads)


def input_penalty(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``L + lam mean_i ||d sum f(x) / dx_i||^2`` (R1's form, on the data)."""
    x = x.detach().requires_grad_()
    out = model(x)
    (gx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    return F.cross_entropy(out, y) + LAM * gx.square().sum(1).mean()


def wgan_gp(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A critic's loss ``f(fake) - f(real)`` (first output) plus ``lam (||d f(x_hat) / dx_hat|| - 1)^2``
    on interpolates ``x_hat`` of the real and fake batches."""
    fake = 0.5 * x.flip(0) + 1.0
    eps = torch.rand(len(x), 1, generator=torch.Generator().manual_seed(3), dtype=x.dtype)
    mix = (eps * x + (1 - eps) * fake).requires_grad_()
    (g,) = torch.autograd.grad(model(mix)[:, 0].sum(), mix, create_graph=True)
    gp = (g.norm(dim=1) - 1).square().mean()
    return model(fake)[:, 0].mean() - model(x)[:, 0].mean() + LAM * gp


PENALTIES = {"param": param_penalty, "input": input_penalty, "wgan_gp": wgan_gp}


def per_example_input_penalty(model: nn.Module, x: torch.Tensor, y: torch.Tensor, weight: float, power: int = 2):
    """``torch.func``: each example's gradient of its own ``loss_i + weight ||d loss_i / d x_i||^power``
    (``vmap`` over ``grad``), by parameter name, ``[B, *param]``."""
    params = {n: p.detach() for n, p in model.named_parameters()}

    def penalized(ps, xi, yi):
        loss_of = lambda inp: F.cross_entropy(functional_call(model, ps, (inp[None],)), yi[None])  # noqa: E731
        return loss_of(xi) + weight * grad(loss_of)(xi).norm() ** power

    return vmap(grad(penalized), in_dims=(None, 0, 0))(params, x, y)
