"""The trainer's layouts beyond plain FSDP: ``trainer.tp`` (tensor parallelism by the
model's plan, ``model=tiny_gpt``) and ``trainer.replicate`` (HSDP), checked before any
process starts; a run under torchrun resumed from a checkpoint mid-epoch ends with the
same bits as the uninterrupted run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import ROOT, free_port, run_train, spawn_ranks
from torch import nn
from torch.nn import functional as F

from gradmod.data import Data
from gradmod.models import TinyGPT, build_model
from gradmod.training.distributed.strategy import Dist, tp_plan
from gradmod.training.trainer import Trainer, TrainerSettings, evaluate


@pytest.fixture
def four_ranks(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "3")


def test_a_layout_that_does_not_divide_the_world_is_one_line(four_ranks):
    cpu = torch.device("cpu")
    for kwargs, words in (
        ({"tp": 3}, "trainer.tp=3 x trainer.replicate=1 does not divide the 4 processes"),
        ({"tp": 2, "replicate": 3}, "trainer.tp=2 x trainer.replicate=3 does not divide"),
        ({"tp": 0}, "trainer.tp=0 must be an int >= 1"),
    ):
        with pytest.raises(ValueError, match=words) as err:
            Dist.from_env("fsdp", cpu, **kwargs)
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="need trainer.strategy=fsdp"):
        Dist.from_env("ddp", cpu, tp=2)


def test_from_the_command_line_a_bad_layout_is_one_line_and_a_failing_exit(tmp_path):
    proc = run_train(tmp_path, "trainer.strategy=fsdp", "trainer.tp=3", "trainer.device=cpu", check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        "error: trainer.tp=3 x trainer.replicate=1 does not divide the 1 processes (WORLD_SIZE); "
        "use a world size that is a multiple of 3"
    ]


def test_a_resume_keeps_the_layout():
    from gradmod.run.resume import compare

    saved = {"trainer": {"strategy": "fsdp", "tp": 2, "replicate": 1}}
    with pytest.raises(ValueError, match=r"trainer.tp: 2 -> 1"):
        compare(saved, {"trainer": {"strategy": "fsdp", "tp": 1, "replicate": 1}})
    with pytest.raises(ValueError, match=r"trainer.replicate: 1 -> 2"):
        compare(saved, {"trainer": {"strategy": "fsdp", "tp": 2, "replicate": 2}})


def test_ranks_of_a_tensor_parallel_group_share_their_data(four_ranks):
    dist = Dist.from_env("fsdp", torch.device("cpu"), tp=2)
    assert (dist.data_rank, dist.data_size) == (1, 2)  # rank 3 is (dp 1, tp 1)
    assert list(range(10))[dist.part] == [1, 3, 5, 7, 9]
    hsdp = Dist.from_env("fsdp", torch.device("cpu"), replicate=2)
    assert (hsdp.data_rank, hsdp.data_size) == (3, 4)  # every HSDP rank has its own data


def test_a_model_without_a_plan_is_refused_and_tiny_gpts_plan_names_its_layers():
    with pytest.raises(ValueError, match="has no tensor-parallel plan"):
        tp_plan(nn.Linear(2, 2), 2)
    model = build_model("tiny_gpt", num_classes=20)
    plan = tp_plan(model, 2)
    linears = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert set(plan) == linears - {"head"}  # every block Linear; the head stays whole


def test_tiny_gpt_is_causal():
    torch.manual_seed(0)
    model = TinyGPT(num_classes=20)
    x = torch.randint(0, 20, (2, 12))
    y = x.clone()
    y[:, 7:] = (y[:, 7:] + 1) % 20  # change the future only
    out, changed = model(x), model(y)
    assert out.shape == (2, 20, 12)
    torch.testing.assert_close(out[..., :7], changed[..., :7])
    assert not torch.allclose(out[..., 7:], changed[..., 7:])


def _by_hand(model: TinyGPT, x: torch.Tensor) -> torch.Tensor:
    """tiny_gpt's forward from its parts, as it was before its head and root owned their
    outputs: the head's product viewed back to N x T x classes, transposed (a view)."""
    h = model.embed(x) + model.position(torch.arange(x.shape[1]))
    for block in model.blocks:
        h = block(h)
    return F.linear(model.norm(h), model.head.weight, model.head.bias).transpose(1, 2)


def test_tiny_gpt_returns_no_view_and_the_same_bits_as_its_view():
    torch.manual_seed(0)
    model = TinyGPT(num_classes=20)
    x, y = torch.randint(0, 20, (3, 12)), torch.randint(0, 20, (3, 12))
    seen: list[torch.Tensor] = []
    model.head.register_forward_hook(lambda m, args, out: seen.append(out))
    out, want = model(x), _by_hand(model, x)
    assert want._is_view() and not out._is_view() and not seen[0]._is_view()
    assert out.stride() == want.stride() and torch.equal(out, want)
    grads = []
    for logits in (out, want):
        model.zero_grad()
        F.cross_entropy(logits, y).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name, g in grads[0].items():
        assert torch.equal(g, grads[1][name]), name


def gpt_and_texts() -> tuple[TinyGPT, dict[int, Data]]:
    """A small tiny_gpt and test sets of 1 and 3 windows: fewer than, and not a multiple of,
    the two data-parallel groups of four ranks with tp=2."""
    torch.manual_seed(6)
    model = TinyGPT(num_classes=11, width=16, depth=1, heads=4, max_len=8)
    g = torch.Generator().manual_seed(7)
    x, y = torch.randint(0, 11, (3, 8), generator=g), torch.randint(0, 11, (3, 8), generator=g)
    return model, {n: Data("text", x, y, x[:n], y[:n], num_classes=11) for n in (1, 3)}


def _evaluate_under_tp(rank: int, port: int, out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="4", LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    dist = Dist.from_env("fsdp", torch.device("cpu"), tp=2).start()
    try:
        model, texts = gpt_and_texts()
        dist.wrap(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        trainer = Trainer(model, optimizer, TrainerSettings(eval_batch_size=1), dist=dist)
        torch.save({n: trainer.test(data) for n, data in texts.items()}, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.close()


@pytest.mark.slow  # four gloo processes
def test_tensor_parallel_evaluation_of_a_test_set_smaller_than_the_data_groups(tmp_path):
    """Rank pairs (0, 1) and (2, 3) share their data; with one test window the second pair gets
    none, with three and one window a batch it gets one batch of one and one empty: an empty
    batch runs its forward passes (every rank gathers alike) and counts nothing."""
    spawn_ranks(_evaluate_under_tp, free_port(), str(tmp_path), nprocs=4)
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(4)]
    model, texts = gpt_and_texts()
    for n, data in texts.items():
        loss, accuracy = evaluate(model, data.test_x, data.test_y)
        for rank in got:
            assert rank[n]["test_loss"] == pytest.approx(loss, rel=1e-5), n
            assert rank[n]["test_accuracy"] == pytest.approx(accuracy, abs=1e-9), n


TINY_GPT = [
    "model=tiny_gpt",
    "data=char_text",
    "data.batch_size=64",
    "data.n_test=64",
    "trainer.strategy=fsdp",
    "trainer.tp=2",
    "trainer.device=cpu",
    "trainer.progress=false",
    "trainer.epochs=1",
    "trainer.eval_batch_size=64",
    "trainer.checkpoint_every_steps=3",
    "trainer.checkpoint_keep=10",
    "+hooks=[norm,log]",
    "trainer.hook_stage=fused",
]


def torchrun(run_dir: Path, *overrides: str, nproc: int = 2) -> None:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--master_port",
        str(free_port()),
        str(ROOT / "train.py"),
        f"hydra.run.dir={run_dir}",
        *overrides,
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=run_dir.parent, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.slow
def test_tiny_gpt_under_tensor_parallelism_resumes_bit_for_bit(tmp_path):
    whole = tmp_path / "whole"
    torchrun(whole, *TINY_GPT)
    mid = whole / "checkpoints" / "step-000000003.pt"  # mid epoch (7 steps an epoch)
    resumed = tmp_path / "resumed"
    torchrun(resumed, *TINY_GPT, f"trainer.resume={mid}")
    want, got = torch.load(whole / "model.pt"), torch.load(resumed / "model.pt")
    assert want.keys() == got.keys() and any(".attn.q." in k for k in want)
    for name in want:
        assert torch.equal(got[name], want[name]), name
    assert (whole / "grad_stats.jsonl").read_text() != ""
