"""SAM under DDP: each rank moves by its own gradient (m-sharpness), only the second pass of
a step's last micro-batch all-reduces; against a single-process computation of that."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from helpers import free_port, spawn_ranks, tiny_mlp
from torch import nn

from gradmod.hooks import attach
from gradmod.testing.epochs import bare_epoch
from gradmod.training.distributed.strategy import Dist, unwrap

RHO, LR, BATCH, WORLD, ACCUMULATE, STEPS = 0.1, 0.5, 4, 2, 2, 2
RULES = {"sam": {"params": "*", "transforms": [{"name": "sam", "rho": RHO}]}}


def _model() -> nn.Module:
    return tiny_mlp(6, 5, 3, act=nn.Tanh)


def _data():
    g = torch.Generator().manual_seed(1)
    n = WORLD * ACCUMULATE * BATCH * STEPS
    return torch.randn(n, 6, generator=g) * 3, torch.randint(0, 3, (n,), generator=g)


def _expected() -> list[torch.Tensor]:
    model = _model()
    params = list(model.parameters())
    x, y = _data()
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(5))
    micro = [order[r::WORLD].split(BATCH) for r in range(WORLD)]
    for s in range(STEPS):
        per_rank = []
        for r in range(WORLD):
            total = [torch.zeros_like(p) for p in params]
            for j in range(s * ACCUMULATE, (s + 1) * ACCUMULATE):
                idx = micro[r][j]
                g = torch.autograd.grad(F.cross_entropy(model(x[idx]), y[idx]) / ACCUMULATE, params)
                norm = torch.sqrt(sum((gi**2).sum() for gi in g))
                e = [RHO * gi / (norm + 1e-12) for gi in g]
                with torch.no_grad():
                    for p, d in zip(params, e):
                        p += d
                g2 = torch.autograd.grad(F.cross_entropy(model(x[idx]), y[idx]) / ACCUMULATE, params)
                with torch.no_grad():
                    for p, d in zip(params, e):
                        p -= d
                total = [t + gi for t, gi in zip(total, g2)]
            per_rank.append(total)
        with torch.no_grad():
            for p, *gs in zip(params, *per_rank):
                p -= LR * sum(gs) / WORLD
    return [p.detach() for p in params]


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    dist = Dist.from_env("ddp", torch.device("cpu"))
    try:
        model = dist.wrap(_model())
        reduces = []

        def comm_hook(state, bucket):
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            reduces.append(1)
            return allreduce_hook(state, bucket)

        model.register_comm_hook(None, comm_hook)
        hooks = attach(unwrap(model), RULES)
        x, y = _data()
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        gen = torch.Generator().manual_seed(5)
        bare_epoch(
            model, opt, x, y, batch_size=BATCH, generator=gen, hooks=hooks, accumulate=ACCUMULATE, part=(rank, WORLD)
        )
        params = [p.detach() for p in unwrap(model).parameters()]
        torch.save({"params": params, "reduces": len(reduces)}, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.close()


@pytest.mark.slow
def test_ddp_sam_is_m_sharpness_with_one_all_reduce_per_step(tmp_path):
    spawn_ranks(_worker, free_port(), str(tmp_path))
    expected = _expected()
    for r in range(WORLD):
        got = torch.load(tmp_path / f"rank{r}.pt")
        assert got["reduces"] == STEPS  # one bucket: the last micro-batch's second pass only
        for a, b in zip(got["params"], expected):
            assert torch.allclose(a, b, rtol=0, atol=1e-6), (a - b).abs().max()
