"""Hooks that don't leak: no doubling, removed when a run fails, bounded `log` memory."""

from __future__ import annotations

import gc
import warnings

import pytest
import torch
import torch.nn.functional as F
from helpers import run_train, tiny_mlp
from torch import nn

import gradmod.run.runner as train_mod
from gradmod.app.cli import run
from gradmod.hooks import attach
from gradmod.training.nonfinite import NonFiniteError

TINY = [
    "data=fake",
    "data.image_size=28",
    "data.channels=1",
    "data.train_size=20",
    "data.test_size=10",
    "data.batch_size=10",
    "trainer.epochs=1",
    "trainer.device=cpu",
    "trainer.progress=false",
    "trainer.checkpoint_every=0",
]


def _hook_count(model: nn.Module) -> int:
    return sum(len(p._backward_hooks or {}) for p in model.parameters()) + sum(
        len(m._forward_hooks) for m in model.modules()
    )


def test_attaching_twice_does_not_double():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2))
    rules = {
        "s": {"params": "*", "transforms": [{"name": "scale", "factor": 2.0}]},
        "o": {"modules": "0", "transforms": ["log"]},
    }
    x = torch.randn(4, 3)
    model(x).sum().backward()
    plain = [p.grad.clone() for p in model.parameters()]
    attach(model, rules)
    first = attach(model, rules)
    assert _hook_count(model) == 3 and len(first) == 3
    model.zero_grad()
    model(x).sum().backward()
    for p, g in zip(model.parameters(), plain):
        assert torch.equal(p.grad, 2 * g)  # scaled once, not twice
    first.remove()
    assert _hook_count(model) == 0


def test_a_failing_run_removes_its_hooks(compose_cfg, tmp_path, monkeypatch):
    seen = []

    def spy(model, rules, **kwargs):
        seen.append(model)
        return attach(model, rules, **kwargs)

    monkeypatch.setattr(train_mod, "attach", spy)
    cfg = compose_cfg(
        *TINY,
        "trainer.nonfinite=raise",
        "+hooks=[clip,log]",
        "+hooks.boom={modules: conv2, transforms: [{name: scale, factor: 1e300}]}",
    )
    with pytest.raises(NonFiniteError):
        run(cfg, tmp_path)
    assert _hook_count(seen[0]) == 0


@pytest.mark.slow  # several processes, each a run
def test_multirun_in_one_process_starts_every_job_with_the_same_hook_count(tmp_path):
    probe = tmp_path / "probe.txt"
    proc = run_train(
        tmp_path,
        *TINY,
        "+hooks=[clip,log]",
        "seed=1,2,3",
        "+hydra.callbacks.probe._target_=tests.support.hook_probe.HookProbe",
        multirun=True,
        env={"GRADMOD_HOOK_PROBE": str(probe)},
    )
    counts = [int(c) for c in probe.read_text().split()]
    assert counts == [0, 0, 0], proc.stdout


def test_log_memory_is_bounded_over_1000_steps(monkeypatch):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: extra threads only add contention
    try:
        _bounded_log()
    finally:
        torch.set_num_threads(threads)


def _bounded_log():
    model = tiny_mlp(4, 3, 2)
    hooks = attach(
        model, {"log": {"params": "*", "transforms": ["log"]}, "out": {"modules": "0", "transforms": ["log"]}}
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))

    def live_tensors() -> int:
        gc.collect()
        with warnings.catch_warnings():  # isinstance on torch's deprecated aliases warns
            warnings.simplefilter("ignore")
            return sum(isinstance(o, torch.Tensor) for o in gc.get_objects())

    counts = {}
    for step in range(1, 1001):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        hooks.take_raw_parts()  # as the trainer's guard does every step
        if step % 50 == 0:
            stats = hooks.read_stats()
            assert len(stats) == 5
        if step in (100, 1000):
            counts[step] = live_tensors()
    assert counts[1000] <= counts[100]  # no growth (an earlier test's tensors may be freed in between)
    assert all(obs.calls == 0 and obs._sum is None for _, obs in hooks.observers())
    hooks.remove()


def test_a_loop_without_a_guard_keeps_no_raw_gradients():
    """The chains keep the raw gradients they replace for the non-finite guard; with none
    taking them, the ledger stops after two backward passes instead of growing; with a
    consumer it keeps every backward's (accumulation) until taken."""
    clip = {"clip": {"params": "*", "transforms": [{"name": "clamp", "bound": 1e-3}]}}
    for consumer in (False, True):
        model = nn.Linear(4, 3)
        hooks = attach(model, clip)
        if consumer:
            hooks.take_raw_parts()  # what the trainer's guard does when it is built
        for _ in range(5):
            model(torch.randn(8, 4)).sum().backward()
        raw, counted, replaced = hooks.take_raw_parts()  # the first backward's transformed .grad in place: counted
        assert len(raw) + len(counted) == (10 if consumer else 0)
        assert replaced == ({"weight", "bias"} if consumer else set())
        hooks.remove()
