"""The paths the hook core takes on CUDA (no host read in the statistics, one foreach op for
all tensors, no kept scratch buffers) run here on CPU tensors under ``accelerator_paths()``,
and give the CPU path's bits: gradients and statistics, finite or not, at every stage."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from gradmod.hooks import attach
from gradmod.hooks.mesh import devices
from gradmod.hooks.stats.rows import BIG
from gradmod.testing.opcount import OpCounter


def _model() -> nn.Module:
    torch.manual_seed(0)
    big = nn.Linear(256, 256)  # 65,536 weights: above BIG, the path of its own
    assert big.weight.numel() >= BIG
    return nn.Sequential(nn.Linear(8, 256), nn.Tanh(), big, nn.Tanh(), nn.Linear(256, 3))


RULES = {
    "hook_clip": {"params": "0.*", "transforms": ["log", {"name": "clamp", "max": 0.01, "min": -0.01}, "log"]},
    "fused_clip": {
        "params": ["2.*", "4.weight"],
        "stage": "fused",
        "transforms": ["log", {"name": "clamp", "min": -0.02, "max": 0.02}, "log"],
    },
    "norm": {"params": "4.bias", "transforms": [{"name": "norm_clip", "max_norm": 0.1}, "log"]},
}
OVERFLOW = {"boom": {"params": ["0.weight", "2.weight"], "transforms": [{"name": "scale", "factor": 1e300}]}}


def _step(rules: dict, accelerator: bool, steps: int = 2):
    model = _model()
    x, y = torch.randn(16, 8, generator=torch.Generator().manual_seed(1)), torch.arange(16) % 3
    with devices.accelerator_paths(accelerator), attach(model, rules) as hooks:
        for _ in range(steps):
            for p in model.parameters():
                p.grad = None
            with OpCounter() as ops:
                nn.functional.cross_entropy(model(x), y).backward()
                hooks.after_backward()
                stats = hooks.read_stats()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return grads, stats, ops.by_op


def _same(a, b, where=""):
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)), where
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b), where
    else:
        assert a == b, where


@pytest.mark.parametrize("rules", [RULES, {**OVERFLOW, **RULES}], ids=["finite", "overflowing"])
def test_accelerator_paths_give_the_cpu_paths_bits(rules):
    cpu_grads, cpu_stats, cpu_ops = _step(rules, accelerator=False)
    acc_grads, acc_stats, acc_ops = _step(rules, accelerator=True)
    _same(cpu_grads, acc_grads, "grad")
    _same(cpu_stats, acc_stats, "stats")
    assert cpu_stats["2.weight/pre"]["norm"] > 0
    if "boom" in rules:
        assert cpu_stats["0.weight/pre"]["nonfinite"] > 0 and cpu_stats["0.weight/post"]["nonfinite"] == 0
    # The paths differ where they should: the CPU reads a value back and loops a big tensor's
    # clamp; the accelerator's path does neither, and clamps every tensor with one foreach op.
    reads = [op for op in acc_ops if "_local_scalar" in op]
    assert not reads, reads
    assert any("_local_scalar" in op for op in cpu_ops)
    assert cpu_ops["aten.clamp_.default"] == 1 and "aten.clamp_.default" not in acc_ops  # 2.weight, alone
    assert acc_ops["aten._foreach_clamp_min_.Scalar"] == cpu_ops["aten._foreach_clamp_min_.Scalar"] >= 2


def test_the_switch_is_scoped_and_reads_the_environment(monkeypatch):
    cpu = torch.device("cpu")
    assert devices.reads_free(cpu) and devices.loops_foreach(cpu)
    with devices.accelerator_paths():
        assert not devices.reads_free(cpu) and not devices.loops_foreach(cpu)
        with devices.accelerator_paths(False):
            assert devices.reads_free(cpu)
    assert devices.reads_free(cpu)
    assert not devices.reads_free(torch.device("meta"))  # no device but the CPU reads for free


def test_a_run_on_the_accelerator_paths_ends_with_the_same_parameters(tmp_path, reference):
    from helpers import RESUMABLE, compose_config, same_params

    from gradmod.app.cli import run

    with devices.accelerator_paths():
        summary = run(compose_config(*RESUMABLE), tmp_path)
    params, ref_summary, ref_metrics = reference
    same_params(torch.load(tmp_path / "model.pt"), params)
    drop = ("seconds", "train_seconds", "eval_seconds")

    def strip(line: str) -> dict:
        return {k: v for k, v in json.loads(line).items() if k not in drop}

    ours = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert ours and [strip(a) for a in ours] == [
        strip(b) for b in ref_metrics.splitlines()
    ]  # losses and gradient statistics too
    assert summary["test_accuracy"] == ref_summary["test_accuracy"]
