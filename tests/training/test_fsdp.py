"""FSDP2 (``fully_shard``) with the hook API, on two gloo processes on the CPU.

Each rank holds one piece of every parameter (dim 0, unevenly: the last layer's single
row lives on rank 0 alone) and backpropagates its half of a batch; FSDP2 averages the
gradients into each rank's shard. The fused stage's results, gathered back to full
tensors, must equal a single process's computation on the whole batch: torch's own
``clip_grad_norm_`` for ``global_norm_clip``, statistics computed directly on the full
gradients for ``log``. The ``hook`` stage must fail loudly, never do nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from helpers import free_port, spawn_ranks
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard

from gradmod.hooks import attach
from gradmod.hooks.fused.group import AGC
from gradmod.models import TinyGPT
from gradmod.reporting import run_summary
from gradmod.testing.epochs import bare_epoch
from gradmod.training.distributed.strategy import Dist

MAX_NORM = 0.05  # below the gradient's norm: the clip bites
BOUND = 0.02


def tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 1))


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 6, generator=g), torch.randn(8, 1, generator=g)


def loss_of(model: nn.Module, rows: slice) -> torch.Tensor:
    x, y = batch()
    return ((model(x[rows]) - y[rows]) ** 2).mean()


def sharded_model() -> nn.Module:
    model = tiny_model()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


RULES = {
    "norm": {"norm": {"params": "*", "transforms": [{"name": "global_norm_clip", "max_norm": MAX_NORM}]}},
    "log": {
        "watch": {
            "params": "*",
            "stage": "fused",
            "transforms": [{"name": "log"}, {"name": "clamp", "min": -BOUND, "max": BOUND}, {"name": "log"}],
        }
    },
    "agc": {"agc": {"params": "*", "transforms": [{"name": "agc", "clip_factor": 0.01}]}},
}


def _step(model: nn.Module, rules: dict, rank: int) -> dict:
    """Attach to the sharded model, backpropagate this rank's half, run the fused stage."""
    hooks = attach(model, rules)
    loss_of(model, slice(4 * rank, 4 * rank + 4)).backward()
    hooks.after_backward()
    out = {"grads": {n: p.grad.full_tensor() for n, p in model.named_parameters()}, "stats": hooks.read_stats()}
    hooks.remove()
    return out


def _error(fn) -> str | None:
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None


def _attach_then_shard(rank: int) -> None:
    model = tiny_model()
    attach(model, {"clip": {"params": "*", "transforms": [{"name": "clamp", "min": -BOUND, "max": BOUND}]}})
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    loss_of(model, slice(4 * rank, 4 * rank + 4)).backward()


class Blocks(nn.Module):
    """A model of one's own: a stem, a list of blocks, a head, and a parameter of the root."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(6, 4)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(2)])
        self.act = nn.Tanh()
        self.head = nn.Linear(4, 1)
        self.scale = nn.Parameter(torch.ones(1))


def _units(dist: Dist) -> list[str]:
    """The modules gradmod's policy shards as units (``Dist.wrap``)."""
    model = dist.wrap(Blocks())
    assert dist.wrap(model) is model  # wrapping twice is wrapping once
    return sorted(n for n, m in model.named_modules() if isinstance(m, FSDPModule))


ZCLIP = {"z": {"params": "*", "transforms": [{"name": "zclip", "warmup_steps": 2, "z_threshold": 0.1}]}}


def zclip_steps(model: nn.Module, rows: slice) -> tuple[dict[str, torch.Tensor], dict]:
    """Three backward passes of ``rows`` through zclip, the loss scaled up each time (the
    third is a spike): the last gradients and zclip's state."""
    hooks = attach(model, ZCLIP)
    for scale in (1.0, 1.5, 4.0):
        model.zero_grad()
        (scale * loss_of(model, rows)).backward()
        hooks.after_backward()
    grads = {n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for n, p in model.named_parameters()}
    return grads, hooks.state_dict()["group"]["z/zclip"]


def classifier() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))


def labelled() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)


def _accumulate(rank: int) -> dict[str, torch.Tensor]:
    """One SGD step of two micro-batches per rank (the first without gradient sync)."""
    model = classifier()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    hooks = attach(model, RULES["norm"])
    x, y = labelled()
    bare_epoch(
        model,
        torch.optim.SGD(model.parameters(), lr=1.0),
        x,
        y,
        batch_size=2,
        generator=torch.Generator().manual_seed(3),
        hooks=hooks,
        accumulate=2,
        part=(rank, 2),
    )
    return {n: p.full_tensor() for n, p in model.named_parameters()}


def gpt_and_text() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(4)
    model = TinyGPT(num_classes=11, width=16, depth=2, heads=4, max_len=8)
    g = torch.Generator().manual_seed(5)
    return model, torch.randint(0, 11, (4, 8), generator=g), torch.randint(0, 11, (4, 8), generator=g)


def _tiny_gpt(dist: Dist, rank: int) -> dict:
    """tiny_gpt sharded by the trainer's policy: the warnings its forward and backward raise, its
    logits and its full gradients for this rank's half of the batch."""
    model, x, y = gpt_and_text()
    dist.wrap(model)
    rows = slice(2 * rank, 2 * rank + 2)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        logits = model(x[rows])
        torch.nn.functional.cross_entropy(logits, y[rows]).backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    return {"warnings": [str(w.message) for w in seen], "logits": logits.detach(), "grads": grads}


def _worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    dist = Dist.from_env("fsdp", torch.device("cpu")).start()
    try:
        results = {case: _step(sharded_model(), rules, rank) for case, rules in RULES.items()}
        hook_rules = {"clip": {"params": "*", "transforms": [{"name": "clamp", "min": -BOUND, "max": BOUND}]}}
        results["hook_stage"] = _error(lambda: attach(sharded_model(), hook_rules))
        results["attach_then_shard"] = _error(lambda: _attach_then_shard(rank))
        sam = {"sam": {"params": "*", "transforms": [{"name": "sam", "rho": 0.05}]}}
        results["sharpness"] = _error(lambda: attach(sharded_model(), sam))
        results["units"] = _units(dist)
        results["accumulate"] = _accumulate(rank)
        results["zclip"] = zclip_steps(sharded_model(), slice(4 * rank, 4 * rank + 4))
        results["tiny_gpt"] = _tiny_gpt(dist, rank)
        torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.close()


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    spawn_ranks(_worker, 2, free_port(), str(out))
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def full_batch_grads() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    model = tiny_model()
    loss_of(model, slice(0, 8)).backward()
    return model, {n: p.grad.clone() for n, p in model.named_parameters()}


def test_sharding_is_uneven_so_the_reductions_matter():
    shapes = {n: p.shape for n, p in tiny_model().named_parameters()}
    assert shapes["2.weight"] == (1, 5)  # one row over two ranks: rank 1's shard is empty


def test_global_norm_clip_equals_clip_grad_norm_on_the_full_batch(fsdp):
    model, _ = full_batch_grads()
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    assert total > MAX_NORM * 2
    for rank in fsdp:
        for name, p in model.named_parameters():
            torch.testing.assert_close(rank["norm"]["grads"][name], p.grad, rtol=1e-5, atol=1e-7, msg=name)
        record = rank["norm"]["stats"]["norm/global_norm_clip"]
        assert record["norm"] == pytest.approx(total.item(), rel=1e-5)
        assert record["clip_coef"] == pytest.approx(MAX_NORM / (total.item() + 1e-6), rel=1e-5)


def test_log_reports_the_full_tensors_statistics(fsdp):
    _, raw = full_batch_grads()
    for rank in fsdp:
        stats = rank["log"]["stats"]
        for name, g in raw.items():
            pre, post = stats[f"{name}/pre"], stats[f"{name}/post"]
            assert pre["calls"] == post["calls"] == 1
            assert pre["norm"] == pytest.approx(torch.linalg.vector_norm(g).item(), rel=1e-5)
            assert (pre["min"], pre["max"]) == pytest.approx((g.min().item(), g.max().item()), rel=1e-6)
            assert pre["mean"] == pytest.approx(g.mean().item(), abs=1e-6 * g.abs().max().item())
            assert pre["frac_negative"] == pytest.approx((g < 0).float().mean().item())
            clamped = g.clamp(-BOUND, BOUND)
            assert post["max"] == pytest.approx(clamped.max().item(), rel=1e-6)
            assert post["frac_clipped"] == pytest.approx((g.abs() > BOUND).float().mean().item())
            torch.testing.assert_close(rank["log"]["grads"][name], clamped, rtol=1e-5, atol=1e-7)
    assert fsdp[0]["log"]["stats"] == fsdp[1]["log"]["stats"]  # every rank reads the same numbers
    assert any(0 < s["frac_clipped"] < 1 for k, s in fsdp[0]["log"]["stats"].items() if k.endswith("/post"))


def test_agc_per_output_unit_matches_one_process(fsdp):
    model, _ = full_batch_grads()
    params = list(model.parameters())
    AGC(clip_factor=0.01).apply_(params, [p.grad for p in params])
    for rank in fsdp:
        for name, p in model.named_parameters():
            torch.testing.assert_close(rank["agc"]["grads"][name], p.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_shard_policy_one_unit_per_block_then_the_root(fsdp):
    for rank in fsdp:
        assert rank["units"] == ["", "blocks.0", "blocks.1", "head", "stem"]


def test_accumulation_reduces_once_and_clips_the_whole_step(fsdp):
    # 8 examples, 2 ranks x 2 micro-batches of 2: the step's gradient is the full batch's mean.
    model = classifier()
    x, y = labelled()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    with torch.no_grad():
        for p in model.parameters():
            p -= p.grad
    for rank in fsdp:
        for name, p in model.named_parameters():
            torch.testing.assert_close(rank["accumulate"][name], p, rtol=1e-5, atol=1e-6, msg=name)


def test_zclip_clips_the_same_spike_with_plain_state(fsdp):
    grads, state = zclip_steps(tiny_model(), slice(0, 8))  # one process, the full batch
    _, raw = full_batch_grads()
    assert not torch.allclose(grads["0.weight"], 4.0 * raw["0.weight"])  # the third call was clipped
    for rank in fsdp:
        got, got_state = rank["zclip"]
        assert type(got_state["mean"]) is torch.Tensor  # a plain tensor: checkpointable as it is
        torch.testing.assert_close(got_state["mean"], state["mean"], rtol=1e-5, atol=1e-7)
        for name, g in grads.items():
            torch.testing.assert_close(got[name], g, rtol=1e-5, atol=1e-7, msg=name)


def test_tiny_gpt_returns_no_view_from_a_unit_and_matches_one_process(fsdp):
    """FSDP2 warns when a unit returns a view (an in-place op on it would skip the unit's
    backward hook): tiny_gpt's head and root return tensors of their own."""
    model, x, y = gpt_and_text()
    logits = model(x)
    torch.nn.functional.cross_entropy(logits, y).backward()  # the mean over both halves
    for rank, got in enumerate(fsdp):
        assert [w for w in got["tiny_gpt"]["warnings"] if "view" in w] == []
        torch.testing.assert_close(got["tiny_gpt"]["logits"], logits[2 * rank : 2 * rank + 2].detach())
        for name, p in model.named_parameters():
            torch.testing.assert_close(got["tiny_gpt"]["grads"][name], p.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_hook_stage_on_sharded_parameters_is_refused_at_attach(fsdp):
    for rank in fsdp:
        message = rank["hook_stage"]
        assert message is not None and "\n" not in message
        assert "hooks.clip: stage 'hook'" in message and "use stage: fused" in message


def test_sharpness_on_sharded_parameters_is_refused_at_attach(fsdp):
    for rank in fsdp:
        message = rank["sharpness"]
        assert message is not None and "\n" not in message
        assert "hooks.sam: stage 'sharpness'" in message and "use trainer.strategy=ddp or one process" in message


def test_rules_attached_before_fully_shard_fail_at_the_first_backward(fsdp):
    for rank in fsdp:
        message = rank["attach_then_shard"]
        assert message is not None and "\n" not in message
        assert "after fully_shard" in message


# --- train.py under torchrun: fsdp against ddp, resume, signals (slow: several 2-process runs) ---

ROOT = Path(__file__).resolve().parents[2]
TINY = [
    "data=fake",
    "data.image_size=28",
    "data.channels=1",
    "data.train_size=80",
    "data.test_size=33",
    "data.batch_size=10",
    "trainer.epochs=2",
    "trainer.device=cpu",
    "trainer.progress=false",
    "trainer.checkpoint_every_steps=3",
    "trainer.eval_batch_size=4",
    "+hooks=norm",
]  # 5 test batches a rank


def torchrun(run_dir: Path, *overrides: str, kill: dict | None = None) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node=2 train.py`` (or the kill driver, with ``kill``'s variables)."""
    entry = ROOT / ("tests/support/kill_driver.py" if kill else "train.py")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--master_port",
        str(free_port()),
        str(entry),
        f"hydra.run.dir={run_dir}",
        *overrides,
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(kill or {})}
    return subprocess.run(cmd, cwd=run_dir.parent, capture_output=True, text=True, env=env, timeout=900)


def ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


@pytest.mark.slow
def test_train_fsdp_matches_ddp_and_both_resume(tmp_path):
    common = ["+hooks=norm", "data=mnist_sample", "trainer.epochs=2", "trainer.device=cpu", "trainer.progress=false"]
    accuracy = {}
    for strategy in ("ddp", "fsdp"):
        run_dir = tmp_path / strategy
        ok(torchrun(run_dir, f"trainer.strategy={strategy}", *common))
        first = summary(run_dir)
        assert first["world_size"] == 2 and first["epochs"] == 2
        ok(
            torchrun(
                run_dir,
                f"trainer.strategy={strategy}",
                *common[:2],
                "trainer.epochs=3",
                *common[3:],
                "trainer.resume=auto",
            )
        )
        resumed = summary(run_dir)
        assert resumed["epochs"] == 3 and resumed["resumed_from"].endswith(f"step-{first['steps']:09d}.pt")
        accuracy[strategy] = (first["test_accuracy"], resumed["test_accuracy"])
    for ddp, fsdp in zip(accuracy["ddp"], accuracy["fsdp"]):
        assert abs(ddp - fsdp) <= 0.005 and ddp > 0.8, accuracy


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_sigkill_then_resume_auto_equals_an_uninterrupted_run(tmp_path, strategy):
    ok(torchrun(tmp_path / "reference", f"trainer.strategy={strategy}", *TINY))
    run_dir = tmp_path / "run"
    killed = torchrun(run_dir, f"trainer.strategy={strategy}", *TINY, kill={"GRADMOD_KILL_AT": "step:7"})
    assert killed.returncode != 0 and run_summary.read(run_dir)["status"] == "killed"  # said running
    ok(torchrun(run_dir, f"trainer.strategy={strategy}", *TINY, "trainer.resume=auto"))
    assert summary(run_dir)["resumed_from"].endswith("step-000000006.pt")  # mid epoch 2 (4 steps each)
    assert summary(run_dir)["steps"] == summary(tmp_path / "reference")["steps"] == 8
    ref, got = torch.load(tmp_path / "reference" / "model.pt"), torch.load(run_dir / "model.pt")
    assert ref.keys() == got.keys()
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=0, atol=1e-6, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_sigterm_to_one_rank_stops_every_rank_at_the_same_step(tmp_path, strategy):
    run_dir = tmp_path / "run"
    proc = torchrun(
        run_dir,
        f"trainer.strategy={strategy}",
        *TINY,
        "trainer.checkpoint_every_steps=0",
        "trainer.checkpoint_every=0",
        kill={"GRADMOD_KILL_AT": "step:2", "GRADMOD_KILL_SIGNAL": "TERM", "GRADMOD_KILL_RANK": "1"},
    )
    assert proc.returncode != 0
    assert "Connection closed by peer" not in proc.stdout + proc.stderr
    stopped = summary(run_dir)
    # Rank 1 noted the signal after step 2's end; the ranks agreed at step 3's end.
    assert stopped["status"] == "interrupted" and stopped["signal"] == "SIGTERM" and stopped["steps"] == 3
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-000000003.pt"]
    ok(torchrun(run_dir, f"trainer.strategy={strategy}", *TINY, "trainer.resume=auto"))
    assert summary(run_dir)["status"] == "ok" and summary(run_dir)["steps"] == 8
