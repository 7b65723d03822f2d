"""``orthogonalize`` on DTensor gradients, on two gloo processes on the CPU: FSDP2
(``Shard(0)``, cut unevenly) and tensor parallelism (``Shard(0)`` and ``Shard(1)``).

Each rank records, per step, the full raw gradient it reduced and the full result after
``orthogonalize`` (with momentum). One process then runs ``orthogonalize`` on the same raw
gradients: each matrix gathered, orthogonalized and re-sharded must equal it (1e-6), and
the momentum every rank saves must equal the one process's.
"""

from __future__ import annotations

import os

import pytest
import torch
from helpers import free_port, spawn_ranks
from torch import nn

from gradmod.hooks import attach
from gradmod.hooks.fused.orthogonalize import Orthogonalize

pytestmark = pytest.mark.slow  # two processes, two layouts: about 25 s on 2 cores

ARGS = {"momentum": 0.9, "nesterov": True, "adjust_lr": "match_rms_adamw"}
RULES = {"o": {"params": "*.weight", "transforms": [{"name": "orthogonalize", **ARGS}]}}
STEPS = 3


def model(hidden: int = 5) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, hidden), nn.Tanh(), nn.Linear(hidden, 3))  # FSDP2: 5 and 3 rows, uneven


def loss_of(net: nn.Module, step: int, rows: slice) -> torch.Tensor:
    g = torch.Generator().manual_seed(10 + step)
    x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
    return ((net(x[rows]) - y[rows]) ** 2).mean()


def _fsdp(rank: int) -> tuple[nn.Module, slice]:
    from torch.distributed.fsdp import fully_shard

    net = model()
    for layer in net[::2]:
        fully_shard(layer)
    fully_shard(net)
    return net, slice(4 * rank, 4 * rank + 4)


def _tp(rank: int) -> tuple[nn.Module, slice]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    net = model(hidden=4)  # the hidden features split evenly between the ranks
    parallelize_module(net, init_device_mesh("cpu", (2,)), {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return net, slice(0, 8)  # both ranks the whole batch


def _case(build, rank: int) -> dict:
    net, rows = build(rank)
    hooks = attach(net, RULES)
    raw, out, placements = [], [], {}
    for step in range(STEPS):
        net.zero_grad()
        loss_of(net, step, rows).backward()
        raw.append({n: p.grad.full_tensor() for n, p in net.named_parameters() if n.endswith("weight")})
        hooks.after_backward()
        out.append({n: p.grad.full_tensor() for n, p in net.named_parameters() if n.endswith("weight")})
        placements = {n: str(p.grad.placements) for n, p in net.named_parameters()}
    return {"raw": raw, "out": out, "state": hooks.state_dict()["group"]["o/orthogonalize"], "placements": placements}


def _worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo")
    try:
        results = {"fsdp": _case(_fsdp, rank), "tp": _case(_tp, rank)}
        torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    finally:
        torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("orthogonalize")
    spawn_ranks(_worker, 2, free_port(), str(out))
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def single(raw: list[dict[str, torch.Tensor]]) -> tuple[list[dict[str, torch.Tensor]], dict]:
    """``orthogonalize`` in one process on the ranks' raw gradients, its buffers by name."""
    params = {n: nn.Parameter(torch.zeros(g.shape)) for n, g in raw[0].items()}
    fn = Orthogonalize(**ARGS)
    fn.bind("o", params)
    out = []
    for grads in raw:
        gs = [grads[n].clone() for n in params]
        fn.apply_(list(params.values()), gs)
        out.append(dict(zip(params, gs)))
    return out, fn.state_dict()


@pytest.mark.parametrize("layout", ["fsdp", "tp"])
def test_gathered_orthogonalized_and_resharded_equals_one_process(ranks, layout):
    for rank in ranks:
        got = rank[layout]
        assert "Shard" in got["placements"]["0.weight"] and "Shard" in got["placements"]["2.weight"]
        expected, state = single(got["raw"])
        for step in range(STEPS):
            for name, g in expected[step].items():
                torch.testing.assert_close(got["out"][step][name], g, rtol=0, atol=1e-6, msg=f"{name} step {step}")
                assert not torch.allclose(g, got["raw"][step][name])  # it changed the gradient
        for name, buf in state["momentum"].items():
            assert type(got["state"]["momentum"][name]) is torch.Tensor  # plain and whole: rank 0 saves it
            torch.testing.assert_close(got["state"]["momentum"][name], buf, rtol=0, atol=1e-6)
    if layout == "tp":
        assert "Shard(dim=1)" in ranks[0]["tp"]["placements"]["2.weight"]  # rowwise: the columns cut
    for name in ranks[0][layout]["raw"][0]:  # every rank the same numbers
        assert torch.equal(ranks[0][layout]["out"][-1][name], ranks[1][layout]["out"][-1][name])
