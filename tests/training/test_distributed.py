"""DDP and gradient accumulation: where each stage acts, against hand computations.

The 2-process tests spawn two gloo processes on the CPU that go through gradmod's own
path (``Dist.from_env`` -> ``Dist.wrap`` -> ``bare_epoch``) and compare the parameters
after one optimizer step with a single-process computation of the documented semantics:
``hook`` = mean over ranks of the transformed local gradients (the hook runs before DDP's
all-reduce), ``fused`` = the transform of the averaged gradient (after it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from helpers import ROOT, free_port, spawn_ranks, tiny_mlp
from torch import nn

from gradmod.hooks import attach
from gradmod.testing.epochs import bare_epoch
from gradmod.training.distributed.ranks import rank_threads
from gradmod.training.distributed.strategy import Dist, follower_overrides, unwrap

BOUND = 0.05  # small enough that the clamp bites on some entries and not on others
LR = 0.5
BATCH = 4


def tiny_model() -> nn.Module:
    return tiny_mlp(6, 5, 3, act=nn.Tanh)


def tiny_data(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 6, generator=g) * 3, torch.randint(0, 3, (n,), generator=g)


def clip_rules(stage: str) -> dict:
    return {"clip": {"params": "*", "stage": stage, "transforms": [{"name": "clamp", "min": -BOUND, "max": BOUND}]}}


def expected_params(stage: str, world: int, accumulate: int, steps: int = 1) -> dict[str, torch.Tensor]:
    """Plain SGD on a hook-free copy, each transform applied by hand where the docs say."""
    model = tiny_model()
    names = [n for n, _ in model.named_parameters()]
    x, y = tiny_data(world * accumulate * BATCH * steps)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(5))
    micro = [order[r::world].split(BATCH) for r in range(world)]  # rank r's micro-batches
    clamp = lambda g: g.clamp(-BOUND, BOUND)  # noqa: E731
    for s in range(steps):
        group = range(s * accumulate, min((s + 1) * accumulate, len(micro[0])))
        per_rank = []
        for r in range(world):
            total = [torch.zeros_like(p) for p in model.parameters()]
            for j in group:
                idx = micro[r][j]
                loss = F.cross_entropy(model(x[idx]), y[idx]) / len(group)
                grads = torch.autograd.grad(loss, list(model.parameters()))
                total = [t + (clamp(g) if stage == "hook" else g) for t, g in zip(total, grads)]
            per_rank.append(total)
        mean = [sum(gs) / world for gs in zip(*per_rank)]
        if stage == "fused":
            mean = [clamp(g) for g in mean]
        with torch.no_grad():
            for p, g in zip(model.parameters(), mean):
                p -= LR * g
    return {n: p.detach().clone() for n, p in zip(names, model.parameters())}


def run_gradmod(model: nn.Module, stage: str, world: int, rank: int, accumulate: int, steps: int = 1) -> None:
    x, y = tiny_data(world * accumulate * BATCH * steps)
    hooks = attach(unwrap(model), clip_rules(stage))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    bare_epoch(
        model,
        optimizer,
        x,
        y,
        batch_size=BATCH,
        generator=torch.Generator().manual_seed(5),
        hooks=hooks,
        accumulate=accumulate,
        part=(rank, world),
    )
    hooks.remove()


CASES = [("hook", 1), ("fused", 1), ("hook", 2), ("fused", 2)]


def _ddp_worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    dist = Dist.from_env("ddp", torch.device("cpu"))
    try:
        for stage, accumulate in CASES:
            model = dist.wrap(tiny_model())  # starts the gloo group the first time
            # What DDP puts into the all-reduce: the bucket of this rank's local gradients.
            seen = []

            def comm_hook(state, bucket, seen=seen):  # this case's list
                seen.append(bucket.buffer().abs().max().item())
                from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

                return allreduce_hook(state, bucket)

            model.register_comm_hook(None, comm_hook)
            run_gradmod(model, stage, world, rank, accumulate)
            params = {n: p.detach() for n, p in unwrap(model).named_parameters()}
            torch.save(
                {"params": params, "allreduce_input_max": seen},
                os.path.join(out, f"{stage}_{accumulate}_rank{rank}.pt"),
            )
    finally:
        dist.close()


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    spawn_ranks(_ddp_worker, 2, free_port(), str(out))
    return {(stage, k, r): torch.load(out / f"{stage}_{k}_rank{r}.pt") for stage, k in CASES for r in range(2)}


@pytest.mark.parametrize("stage,accumulate", CASES)
def test_ddp_step_matches_documented_stage_semantics(ddp_results, stage, accumulate):
    rank0, rank1 = (ddp_results[stage, accumulate, r]["params"] for r in range(2))
    expected = expected_params(stage, world=2, accumulate=accumulate)
    other = expected_params("fused" if stage == "hook" else "hook", world=2, accumulate=accumulate)
    assert any(not torch.allclose(expected[n], other[n], atol=1e-6) for n in expected), (
        "the test data must tell the stages apart"
    )
    for name in expected:
        assert torch.equal(rank0[name], rank1[name]), f"{name} differs between ranks"
        torch.testing.assert_close(rank0[name], expected[name], rtol=1e-5, atol=1e-6, msg=name)


def test_hook_runs_before_ddp_reads_the_gradient(ddp_results):
    # One bucket (a small model), all-reduced once per optimizer step. With the hook stage
    # the bucket already holds clamped local gradients; with fused it does not.
    for r in range(2):
        hook_seen = ddp_results["hook", 1, r]["allreduce_input_max"]
        fused_seen = ddp_results["fused", 1, r]["allreduce_input_max"]
        assert len(hook_seen) == len(fused_seen) == 1
        assert hook_seen[0] <= BOUND + 1e-7 < fused_seen[0]
        # accumulate=2: no_sync on the first micro-batch, so one all-reduce of the sum of
        # two clamped micro-batch gradients.
        acc_seen = ddp_results["hook", 2, r]["allreduce_input_max"]
        assert len(acc_seen) == 1 and BOUND < acc_seen[0] <= 2 * BOUND + 1e-7


@pytest.mark.parametrize("stage", ["hook", "fused"])
def test_accumulation_single_process(stage):
    # 3 micro-batches, accumulate=2: a step of two (each loss / 2), then a step of one.
    model = tiny_model()
    x, y = tiny_data(3 * BATCH)
    hooks = attach(model, clip_rules(stage))
    steps = []
    bare_epoch(
        model,
        torch.optim.SGD(model.parameters(), lr=LR),
        x,
        y,
        batch_size=BATCH,
        generator=torch.Generator().manual_seed(5),
        hooks=hooks,
        accumulate=2,
        on_step=steps.append,
    )
    assert steps == [1, 2]
    # Hand computation: the same two steps.
    ref = tiny_model()
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(5)).split(BATCH)
    for group in ([order[0], order[1]], [order[2]]):
        grads = [
            torch.autograd.grad(F.cross_entropy(ref(x[i]), y[i]) / len(group), list(ref.parameters())) for i in group
        ]
        if stage == "hook":  # each micro-batch's gradient (of loss / k), then summed
            update = [sum(g.clamp(-BOUND, BOUND) for g in gs) for gs in zip(*grads)]
        else:  # the sum, then clamped
            update = [sum(gs).clamp(-BOUND, BOUND) for gs in zip(*grads)]
        with torch.no_grad():
            for p, u in zip(ref.parameters(), update):
                p -= LR * u
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_accumulating_two_half_batches_is_one_full_batch():
    b = tiny_model()
    x, y = tiny_data(2 * BATCH)
    bare_epoch(
        b,
        torch.optim.SGD(b.parameters(), lr=LR),
        x,
        y,
        batch_size=2 * BATCH,
        generator=torch.Generator().manual_seed(5),
    )
    c = tiny_model()
    bare_epoch(
        c,
        torch.optim.SGD(c.parameters(), lr=LR),
        x,
        y,
        batch_size=BATCH,
        generator=torch.Generator().manual_seed(5),
        accumulate=2,
    )
    for p, q in zip(b.parameters(), c.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_strategy_refuses_unknown_names_and_a_mismatch_with_torchrun(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("SLURM_PROCID", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match=r"trainer.strategy='dp'.*allowed: single, ddp"):
        Dist.from_env("dp", cpu)
    with pytest.raises(ValueError, match="torchrun --nproc_per_node"):
        Dist.from_env("ddp", cpu)
    with pytest.raises(ValueError, match="trainer.strategy=fsdp needs .*train.py trainer.strategy=fsdp"):
        Dist.from_env("fsdp", cpu)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="add trainer.strategy=ddp"):
        Dist.from_env("single", cpu)


def test_follower_overrides():
    assert follower_overrides(["train.py"], {"RANK": "0"}) == []
    assert follower_overrides(["train.py"], {}) == []
    assert "hydra.output_subdir=null" in follower_overrides(["train.py"], {"RANK": "1"})
    assert follower_overrides(["train.py", "-m"], {"RANK": "1"}) == []


def test_rank_threads_share_the_node_where_torchrun_set_none():
    torchrun_one_a_node = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1"}
    assert rank_threads(torchrun_one_a_node, cores=16) == 16  # the node's cores, its one rank's
    assert rank_threads({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}, cores=16) == 4
    assert rank_threads({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}, cores=2) == 1  # at least one
    assert rank_threads({**torchrun_one_a_node, "OMP_NUM_THREADS": "3"}, cores=16) == 0  # the user's: kept
    assert rank_threads({}, cores=16) == 0  # one process: torch's own choice


TORCHRUN_RUN = [
    "trainer.strategy=ddp",
    "+hooks=clip",
    "data=fake",
    "data.image_size=28",
    "data.channels=1",
    "data.train_size=64",
    "data.test_size=33",
    "data.batch_size=16",
    "trainer.epochs=1",
    "trainer.device=cpu",
    "trainer.progress=false",
]


@pytest.mark.slow  # three torchrun launches (about 25 s on 2 cores)
def test_two_nodes_of_one_rank_equal_one_node_of_two_bitwise(tmp_path):
    """``--nnodes=2 --nproc_per_node=1`` (two torchrun agents meeting on localhost, each
    "node" one core of this host, as taskset pins it) trains the same weights, bit for bit,
    as ``--nnodes=1 --nproc_per_node=2``; each rank took its node's cores (1), set by
    gradmod where torchrun sets no OMP_NUM_THREADS; rank 0 alone wrote the run folder."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["PYTHONPATH"] = str(ROOT)
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    port = free_port()
    nodes = []
    for node in (0, 1):
        cwd = tmp_path / f"node{node}"
        cwd.mkdir()
        pin = ["taskset", "-c", str(node % (os.cpu_count() or 1))]
        cmd = [*pin, *torchrun, "--nnodes=2", "--nproc_per_node=1", f"--node_rank={node}"]
        cmd += ["--master_addr=127.0.0.1", f"--master_port={port}", str(ROOT / "train.py")]
        cmd += [*TORCHRUN_RUN, f"hydra.run.dir={tmp_path / 'two_nodes'}"]
        nodes.append(subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    outputs = [p.communicate(timeout=600)[0].decode() for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], outputs
    one = [*torchrun, "--nnodes=1", "--nproc_per_node=2", f"--master_port={free_port()}", str(ROOT / "train.py")]
    one += [*TORCHRUN_RUN, f"hydra.run.dir={tmp_path / 'one_node'}"]
    proc = subprocess.run(one, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    two, single = (torch.load(tmp_path / d / "model.pt") for d in ("two_nodes", "one_node"))
    assert two.keys() == single.keys() and all(torch.equal(two[k], single[k]) for k in two)
    summaries = [json.loads((tmp_path / d / "summary.json").read_text()) for d in ("two_nodes", "one_node")]
    assert [s["world_size"] for s in summaries] == [2, 2]
    assert [s["threads"] for s in summaries] == [1, 1]  # one core a node / one rank; torchrun's 1
    assert [sorted(p.name for p in (tmp_path / f"node{n}").iterdir()) for n in (0, 1)] == [[], []]


@pytest.mark.slow
def test_torchrun_two_ranks_end_to_end(tmp_path):
    """The documented DDP command on 2 gloo ranks: rank 0 alone writes the run folder."""
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--master_port",
        str(free_port()),
        str(ROOT / "train.py"),
        *TORCHRUN_RUN,
        f"hydra.run.dir={run_dir}",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2
    assert summary["steps"] == 2  # 64 images, 32 per rank, batches of 16
    assert summary["test_size"] == 33  # every test image once, over both ranks
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 1 and metrics[0]["step"] == 2
    state = torch.load(run_dir / "model.pt")
    assert not any(k.startswith("module.") for k in state)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # rank 1 wrote nothing in its cwd
