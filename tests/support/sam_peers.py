"""pytorch-optimizer's SAM family run as its documentation shows, with its perturbation norm
taken in the parameters' dtype (float64 here; it takes it in float32, the only difference
from gradmod found), and the small models the sharpness tests compare on."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

Loss = Callable[[], torch.Tensor]


def cnn(seed: int = 0) -> nn.Module:
    """A convolution, BatchNorm and a linear head, float64."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 5 * 5, 5)
    ).double()


class Encoder(nn.Module):
    """One transformer encoder layer (attention, LayerNorm, feed-forward), mean-pooled, a linear head."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True)
        self.head = nn.Linear(8, 5)
        self.double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer(x).mean(dim=1))


MODELS = {"cnn": (cnn, (8, 3, 5, 5)), "transformer": (Encoder, (6, 4, 8))}


def data(model: str, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = MODELS[model][1]
    return torch.randn(*shape, generator=g, dtype=torch.float64), torch.randint(0, 5, (shape[0],), generator=g)


def build(model: str) -> nn.Module:
    return MODELS[model][0]()


def norm_in_dtype(param_groups, device=None, *, weight_adaptive: bool = False) -> torch.Tensor:
    """pytorch-optimizer's ``get_global_gradient_norm`` (the squared global norm) without its
    cast to float32."""
    grads = []
    for group in param_groups:
        adaptive = weight_adaptive and group.get("adaptive", False)
        grads += [p.grad * p.abs() if adaptive else p.grad for p in group["params"] if p.grad is not None]
    return torch.stack([g.norm() for g in grads]).square().sum().reshape(1)


def closure_steps(opt, model: nn.Module, loss_fn: Loss, steps: int, after=None) -> None:
    """SAM, LookSAM, FriendlySAM: the gradient at ``w``, then ``step(closure)``; the closure's
    forward under the library's own BatchNorm bypass (momentum 0), as davda54/sam's README shows."""
    from pytorch_optimizer.optimizer.utils.model import disable_running_stats, enable_running_stats

    def closure():
        loss = loss_fn()
        loss.backward()
        return loss

    for _ in range(steps):
        opt.zero_grad()
        enable_running_stats(model)
        closure()
        disable_running_stats(model)
        opt.step(closure)
        enable_running_stats(model)
        if after is not None:
            after()


def wsam_steps(opt, loss_fn: Loss, steps: int) -> None:
    """WSAM runs both closures itself (and its own BatchNorm bypass)."""

    def closure():
        loss = loss_fn()
        loss.backward()
        return loss

    for _ in range(steps):
        opt.zero_grad()
        opt.step(closure)


def gsam_steps(opt, x, y, steps: int, scheduler) -> None:
    """GSAM: ``set_closure``, ``step()``, the LR scheduler, ``update_rho_t()``."""
    for _ in range(steps):
        opt.set_closure(lambda out, target: F.cross_entropy(out, target), x, y)
        opt.step()
        scheduler.step()
        opt.update_rho_t()
