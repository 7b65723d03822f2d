"""The penalty rules under DDP (two gloo processes through gradmod's own path): each rank's loss
gains its own term, DDP averages the gradients of the whole losses, as a hand-written loop does;
beside DP-SGD's clip, each example's penalized gradient is clipped and the ranks' sums averaged."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from helpers import free_port, spawn_ranks
from penalties import per_example_input_penalty
from test_distributed import BATCH, LR, tiny_data, tiny_model

from gradmod.hooks import attach
from gradmod.testing.epochs import bare_epoch
from gradmod.training.distributed.strategy import Dist, unwrap

W, C = 0.3, 0.5
RULES = {
    "grad_penalty": {"p": {"params": "0.*", "transforms": [{"name": "grad_penalty", "weight": W}]}},
    "input_grad_penalty": {"p": {"modules": "@input", "transforms": [{"name": "input_grad_penalty", "weight": W}]}},
    "dp_input_grad_penalty": {
        "p": {"modules": "@input", "transforms": [{"name": "input_grad_penalty", "weight": W}]},
        "dp": {"params": "*", "transforms": [{"name": "per_sample_clip", "max_norm": C}]},
    },
}


def _worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    dist = Dist.from_env("ddp", torch.device("cpu"))
    try:
        for rule, rules in RULES.items():
            model = dist.wrap(tiny_model())
            x, y = tiny_data(world * BATCH)
            hooks = attach(unwrap(model), rules)
            opt = torch.optim.SGD(model.parameters(), lr=LR)
            gen = torch.Generator().manual_seed(5)
            bare_epoch(model, opt, x, y, batch_size=BATCH, generator=gen, hooks=hooks, part=(rank, world))
            hooks.remove()
            torch.save(
                {n: p.detach() for n, p in unwrap(model).named_parameters()}, os.path.join(out, f"{rule}{rank}.pt")
            )
    finally:
        dist.close()


def _expected(rule: str, world: int) -> dict[str, torch.Tensor]:
    model = tiny_model()
    x, y = tiny_data(world * BATCH)
    if rule.startswith("dp_"):  # every example's own penalized gradient (torch.func), clipped, their mean
        per = per_example_input_penalty(model, x, y, W)
        norms = torch.cat([g.flatten(1) for g in per.values()], 1).norm(dim=1)
        factor = (C / (norms + 1e-6)).clamp(max=1.0)
        with torch.no_grad():
            return {n: p - LR * torch.tensordot(factor, per[n], 1) / len(y) for n, p in model.named_parameters()}
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(5))
    total = [torch.zeros_like(p) for p in model.parameters()]
    for r in range(world):
        part = order[r::world]
        xb, yb = x[part].clone().requires_grad_(), y[part]
        loss = F.cross_entropy(model(xb), yb)
        if rule == "grad_penalty":
            grads = torch.autograd.grad(loss, list(model[0].parameters()), create_graph=True)
            term = sum(g.square().sum() for g in grads)
        else:
            (g,) = torch.autograd.grad(loss, xb, create_graph=True)
            term = (len(part) * g).square().sum(1).mean()
        for t, g in zip(total, torch.autograd.grad(loss + W * term, list(model.parameters()))):
            t += g / world
    with torch.no_grad():
        return {n: p - LR * g for (n, p), g in zip(model.named_parameters(), total)}


@pytest.mark.slow
def test_ddp_averages_each_ranks_penalized_gradient(tmp_path):
    spawn_ranks(_worker, 2, free_port(), str(tmp_path))
    for rule in RULES:
        want = _expected(rule, 2)
        for r in range(2):
            got = torch.load(tmp_path / f"{rule}{r}.pt")
            assert max(float((got[n] - want[n]).abs().max()) for n in want) <= 1e-6, (rule, r)
