"""SAM written out by hand: the reference the sharpness tests compare gradmod with."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def mlp(dtype=torch.float64, norm: bool = False, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    layers = [nn.Linear(6, 16)] + ([nn.BatchNorm1d(16)] if norm else []) + [nn.Tanh(), nn.Linear(16, 4)]
    return nn.Sequential(*layers).to(dtype)


def shift(params, grads, rho, adaptive=False, eta=0.0):
    """Hand-written e per rule: rho T^2 g / (||T g|| + 1e-12), T = 1 (SAM) or |w| + eta."""
    t = [(p.abs() + eta) if adaptive else torch.ones_like(p) for p in params]
    norm = torch.sqrt(sum(((ti * g) ** 2).sum() for ti, g in zip(t, grads)))
    return [rho * ti * ti * g / (norm + 1e-12) for ti, g in zip(t, grads)]


def hand_sam(model, x, y, steps, rho, moved=None, every=1, micro=1, adaptive=False, opt=None):
    """SAM written out: gradient at w, move the ``moved`` names by e, gradient at w + e of
    every parameter, move back, SGD step; BatchNorm running statistics kept from pass 2."""
    opt = opt or torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    named = dict(model.named_parameters())
    names = list(named) if moved is None else moved
    bns = [m for m in model.modules() if isinstance(m, nn.BatchNorm1d)]
    for step in range(steps):
        total = [torch.zeros_like(p) for p in model.parameters()]
        for xb, yb in zip(x.chunk(micro), y.chunk(micro)):
            loss = F.cross_entropy(model(xb), yb) / micro
            if (step + 1) % every:
                grads = torch.autograd.grad(loss, list(model.parameters()))
            else:
                g = torch.autograd.grad(loss, [named[n] for n in names])
                r = rho(step) if callable(rho) else rho  # a schedule: rho of the steps done
                e = shift([named[n] for n in names], g, r, adaptive)
                with torch.no_grad():
                    for n, d in zip(names, e):
                        named[n].add_(d)
                stats = [(b.running_mean.clone(), b.running_var.clone()) for b in bns]
                loss2 = F.cross_entropy(model(xb), yb) / micro
                grads = torch.autograd.grad(loss2, list(model.parameters()))
                with torch.no_grad():
                    for n, d in zip(names, e):
                        named[n].sub_(d)
                    for b, (m, v) in zip(bns, stats):
                        b.running_mean.copy_(m)
                        b.running_var.copy_(v)
                        b.num_batches_tracked.sub_(1)
            total = [a + b for a, b in zip(total, grads)]
        for p, g in zip(model.parameters(), total):
            p.grad = g
        opt.step()
    return model
