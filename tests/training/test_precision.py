"""Mixed precision: scale-aware hook-stage transforms, the fused stage after unscale_,
bf16/fp16 runs on the CPU."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import tiny_mlp

from gradmod.app.cli import run
from gradmod.hooks import attach
from gradmod.training.nonfinite import NonFiniteGuard
from gradmod.training.precision import Precision

CPU = torch.device("cpu")
CLAMP = [{"name": "clamp", "min": -0.01, "max": 0.01}]


def _model():
    return tiny_mlp(6, 5, 3)


def _loss(model):
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
    return F.cross_entropy(model(x), y)


@pytest.mark.parametrize("stage", ["hook", "fused"])
def test_fp16_scaled_gradients_get_fp32_thresholds(stage):
    """With a 2**16 loss scale, clamp(-0.01, 0.01) at either stage gives exactly the
    fp32 result: clamp of the true gradient (torch.nn.utils.clip_grad_value_)."""
    ref = _model()
    _loss(ref).backward()
    torch.nn.utils.clip_grad_value_(ref.parameters(), 0.01)

    model = _model()
    hooks = attach(model, {"c": {"params": "*", "transforms": CLAMP, "stage": stage}})
    amp = Precision("fp16", CPU)  # the scaler only; the forward stays fp32 for exact arithmetic
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    amp.backward(_loss(model), hooks)
    assert amp.scale() == 2.0**16
    amp.unscale_(opt)
    if hooks.stage("fused") is not None:
        hooks.after_backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)
    assert max(p.grad.abs().max() for p in model.parameters()) == pytest.approx(0.01)
    hooks.remove()


def test_without_scale_awareness_the_threshold_would_be_wrong():
    """The control: a hook that does not unscale clamps 2**16-times larger values, so
    after unscale_ every gradient is ~0.01 / 2**16 (the reason for the scale-aware chain)."""
    model = _model()
    hooks = attach(model, {"c": {"params": "*", "transforms": CLAMP}})
    scaler = torch.amp.GradScaler("cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler.scale(_loss(model)).backward()  # hooks.grad_scale left unset
    scaler.unscale_(opt)
    assert max(p.grad.abs().max() for p in model.parameters()) <= 0.01 / 2**16
    hooks.remove()


def test_fp16_overflow_is_skipped_by_the_scaler_even_under_raise():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = copy.deepcopy(model.state_dict())
    amp = Precision("fp16", CPU)
    amp.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**127)  # overflows fp32 gradients
    guard = NonFiniteGuard(model, None, "raise")
    amp.backward(_loss(model) * 1e10)
    guard.observe()
    amp.unscale_(opt)
    skip = guard.check(amp.scale())
    amp.step(opt, skip)
    assert skip and guard.skipped == 1
    assert amp.scale() == 2.0**126  # backed off
    for k, v in before.items():
        assert torch.equal(model.state_dict()[k], v)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_run_on_cpu(compose_cfg, tmp_path, precision, caplog):
    cfg = compose_cfg(
        "data=fake",
        "data.image_size=28",
        "data.channels=1",
        "data.train_size=40",
        "data.test_size=10",
        "data.batch_size=10",
        "trainer.epochs=1",
        "trainer.device=cpu",
        "trainer.progress=false",
        "trainer.checkpoint_every=0",
        f"trainer.precision={precision}",
        "+hooks=[clip,log]",
    )
    summary = run(cfg, tmp_path)
    assert summary["precision"] == precision and summary["steps"] == 4
    assert torch.isfinite(torch.tensor(summary["train_loss"]))
    assert summary["skipped_steps"] == 0
    slow = [r.message for r in caplog.records if "float16 kernels on a CPU are slow" in r.message]
    assert len(slow) == (precision == "fp16")  # fp16 on a CPU is named as slow, once; bf16 is not
