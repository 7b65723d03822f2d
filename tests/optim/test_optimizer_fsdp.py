"""Optimizer groups under FSDP2, on two gloo processes on the CPU: AdamW with an SGD entry on
the last layer, and Muon on the hidden matrix, as one optimizer over the sharded parameters,
equal to one process on the whole batch; DCP's full state dict restores it."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from helpers import free_port, spawn_ranks
from torch import nn
from torch.distributed.fsdp import fully_shard

import gradmod
from gradmod.training.distributed.strategy import Dist

SPECS = {
    "sgd_entry": {
        "_target_": "torch.optim.AdamW",
        "lr": 1e-2,
        "weight_decay": 0.1,
        "groups": [{"params": "@last_layer", "optimizer": {"_target_": "torch.optim.SGD", "lr": 0.1, "momentum": 0.9}}],
    },
    "muon": {
        "_target_": "torch.optim.AdamW",
        "lr": 1e-2,
        "groups": [{"params": "@matrices", "optimizer": {"_target_": "gradmod.optim.Muon", "lr": 0.02}}],
    },
}

# Muon's Newton-Schulz runs in bfloat16 on the sharded matrices (DTensor matmuls), its sums in
# another order than one process's: after 4 steps the weights differ by at most 2.6e-3 here,
# where each step moves a hidden weight by about lr = 0.02.
TOLERANCE = {"sgd_entry": 2e-6, "muon": 5e-3}


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))


def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)


def train(net, opt, steps, rows=slice(None)):
    for step in steps:
        x, y = data(step)
        opt.zero_grad()
        nn.functional.cross_entropy(net(x[rows]), y[rows]).backward()
        opt.step()


def sharded() -> nn.Module:
    net = model()
    for layer in net:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    return fully_shard(net)


def _worker(rank: int, port: int, out: str) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict as set_state

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    dist = Dist.from_env("fsdp", torch.device("cpu")).start()
    try:
        results = {}
        rows = slice(4 * rank, 4 * rank + 4)
        for case, spec in SPECS.items():
            net = sharded()
            opt = gradmod.optimizer(net, spec)
            train(net, opt, range(2), rows)
            full = get_optimizer_state_dict(net, opt, options=StateDictOptions(full_state_dict=True))
            full = copy.deepcopy(full)  # as from a file: the step counters are not shared
            weights = {n: p.full_tensor().detach() for n, p in net.named_parameters()}  # at step 2
            train(net, opt, range(2, 4), rows)
            again = sharded()
            for (_, p), w in zip(again.named_parameters(), weights.values()):
                p.detach().copy_(torch.distributed.tensor.distribute_tensor(w, p.device_mesh, p.placements))
            restored = gradmod.optimizer(again, spec)
            set_state(again, restored, full, options=StateDictOptions(full_state_dict=True))
            train(again, restored, range(2, 4), rows)
            results[case] = (
                {n: p.full_tensor() for n, p in net.named_parameters()},
                {n: p.full_tensor() for n, p in again.named_parameters()},
            )
        torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.close()


@pytest.mark.slow
def test_groups_under_fsdp2_equal_one_process_and_restore_from_dcp(tmp_path):
    spawn_ranks(_worker, free_port(), str(tmp_path))
    results = torch.load(tmp_path / "rank0.pt")
    for case, spec in SPECS.items():
        straight, restored = results[case]
        one = model()
        train(one, gradmod.optimizer(one, spec), range(4))
        for n, p in one.named_parameters():
            torch.testing.assert_close(straight[n], p.detach(), atol=TOLERANCE[case], rtol=0, msg=f"{case} {n}")
            assert torch.equal(restored[n], straight[n]), f"{case} {n}"
