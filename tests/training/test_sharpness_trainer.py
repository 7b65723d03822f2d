"""The sharpness stage in gradmod's Trainer: the same steps as a loop over the core API,
under accumulation and mixed precision, and a resume that continues bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import TINY_FAKE, same_params
from sam_reference import hand_sam as _hand_sam
from sam_reference import mlp as _mlp

import gradmod.hooks as H
from gradmod.app.cli import run
from gradmod.run.folder import checkpoint_file as ckpt
from gradmod.testing.epochs import bare_epoch
from gradmod.training.loader import batches
from gradmod.training.precision import Precision


def _data(n: int = 32):
    g = torch.Generator().manual_seed(5)
    return torch.randn(n, 6, generator=g, dtype=torch.float64), torch.randint(0, 4, (n,), generator=g)


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)


def test_trainer_with_accumulation_equals_hand_written_sam():
    x, y = _data()
    model = _mlp(norm=True)
    hooks = H.attach(model, {"sam": {"params": "*", "transforms": [{"name": "sam", "rho": 0.05}]}})
    bare_epoch(
        model, _sgd(model), x, y, batch_size=4, generator=torch.Generator().manual_seed(7), hooks=hooks, accumulate=2
    )
    # The same 4 steps of 2 micro-batches, in the trainer's order, written out.
    ref = _hand_steps(_mlp(norm=True), list(batches(x, y, 4, torch.Generator().manual_seed(7))))
    worst = max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
    assert worst < 1e-10, worst
    assert torch.allclose(model[1].running_mean, ref[1].running_mean, rtol=0, atol=1e-12)


def _hand_steps(model, order):
    """_hand_sam over the trainer's micro-batches, two per step, one optimizer kept across steps."""
    opt = _sgd(model)
    for i in range(0, len(order), 2):
        pair = order[i : i + 2]
        _hand_sam(model, torch.cat([b[0] for b in pair]), torch.cat([b[1] for b in pair]), 1, 0.05, micro=2, opt=opt)
    return model


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_steps_equal_the_core_loop(precision):
    x, y = _data()
    x = x.float()
    rules = {"sam": {"params": "*", "transforms": [{"name": "sam", "rho": 0.05}]}}
    model = _mlp(torch.float32)
    bare_epoch(
        model,
        _sgd(model),
        x,
        y,
        batch_size=8,
        generator=torch.Generator().manual_seed(3),
        hooks=H.attach(model, rules),
        amp=Precision(precision, torch.device("cpu")),
    )
    ref = _mlp(torch.float32)
    opt, hooks, amp = _sgd(ref), H.attach(ref, rules), Precision(precision, torch.device("cpu"))
    scaler = amp.scaler
    for xb, yb in batches(x, y, 8, torch.Generator().manual_seed(3)):
        opt.zero_grad()

        def loss(xb=xb, yb=yb):
            with torch.autocast("cpu", dtype=amp.dtype):
                out = F.cross_entropy(ref(xb), yb)
            return out if scaler is None else scaler.scale(out)

        if scaler is not None:
            hooks.set_grad_scale(scaler._scale)
        hooks.backward(loss(), closure=loss)
        hooks.after_backward()
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
    same_params(model.state_dict(), ref.state_dict())


def test_fp16_overflow_in_the_first_pass_skips_the_step_and_keeps_the_weights():
    model = _mlp(torch.float32)
    x, y = _data()
    amp = Precision("fp16", torch.device("cpu"))
    amp.scaler._init_scale = 2.0**127  # the scaled gradient overflows float32's range
    before = {k: v.clone() for k, v in model.state_dict().items()}
    hooks = H.attach(model, {"sam": {"params": "*", "transforms": [{"name": "sam", "rho": 0.05}]}})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    bare_epoch(model, opt, x.float()[:8], y[:8], batch_size=8, generator=torch.Generator(), hooks=hooks, amp=amp)
    same_params(model.state_dict(), before)
    assert amp.scaler.get_scale() < 2.0**127


def test_resume_mid_epoch_is_exact_with_every_and_accumulation(tmp_path, compose_cfg):
    over = [
        *TINY_FAKE,
        "+hooks=sam",
        "hooks.sam.transforms.0.every=2",
        "trainer.accumulate=2",
        "trainer.epochs=1",
        "trainer.checkpoint_every_steps=1",
        "trainer.checkpoint_keep=10",
    ]
    full = tmp_path / "full"
    run(compose_cfg(*over), full)
    first = full / "checkpoints" / "step-000000001.pt"  # the next step is a two-pass one
    summary = run(compose_cfg(*over, f"trainer.resume={first}"), tmp_path / "resumed")
    assert summary["resumed_from"] == str(first)
    same_params(torch.load(tmp_path / "resumed" / "model.pt"), torch.load(full / "model.pt"))


@pytest.mark.parametrize("hooks", ["looksam", "friendly_sam"])
def test_resume_of_a_stateful_sharpness_rule_is_exact(hooks, tmp_path, compose_cfg):
    """LookSAM's orthogonal part and Friendly SAM's momentum are in the checkpoint: a run
    resumed from step 3 (k=2: the next step reuses the part kept at step 2) ends bit for bit
    as the run that did not stop."""
    over = [
        *TINY_FAKE,
        f"+hooks={hooks}",
        "trainer.epochs=1",
        "trainer.checkpoint_every_steps=1",
        "trainer.checkpoint_keep=10",
        *(["hooks.looksam.transforms.0.k=2"] if hooks == "looksam" else []),
    ]
    full = tmp_path / "full"
    run(compose_cfg(*over), full)
    third = full / "checkpoints" / "step-000000003.pt"
    kept = ckpt.load(third)
    assert kept["hooks"]["sharpness"]["rules"][hooks]  # the state is there, by parameter name
    run(compose_cfg(*over, f"trainer.resume={third}"), tmp_path / "resumed")
    same_params(torch.load(tmp_path / "resumed" / "model.pt"), torch.load(full / "model.pt"))


@pytest.mark.parametrize("hooks", ["gsam", "wsam"])
def test_the_trainer_hands_the_optimizer_to_the_rules_that_read_it(hooks, tmp_path, compose_cfg):
    """gsam's rho follows the cosine schedule's learning rate, wsam moves after the step:
    both need the optimizer, which the trainer hands over (one's own loop without it is refused)."""
    summary = run(compose_cfg(*TINY_FAKE, f"+hooks={hooks}", "scheduler=cosine", "trainer.epochs=1"), tmp_path)
    assert summary["status"] == "ok"
