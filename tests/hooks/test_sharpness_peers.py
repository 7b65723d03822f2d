"""GSAM, WSAM, LookSAM, Friendly SAM and SAM with gradient centralisation against
pytorch-optimizer 4.1.0, float64, 10 steps, on a CNN with BatchNorm and a transformer
encoder layer: the parameters equal to 1e-10, the running statistics too, counted once per
step where the library counts them twice."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from sam_peers import build, closure_steps, data, gsam_steps, norm_in_dtype, wsam_steps

import gradmod.hooks as H

STEPS = 10
SGD = {"lr": 0.05, "momentum": 0.9, "weight_decay": 5e-4}


def _rule(*transforms) -> dict:
    return {"sharp": {"params": "*", "transforms": list(transforms)}}


# case -> (gradmod's transforms, the library's class and arguments, a cosine LR schedule)
CASES = {
    "sam_gc": (["centralize", {"name": "sam", "rho": 0.1}], ("SAM", {"rho": 0.1, "use_gc": True}), False),
    "gsam": (
        [{"name": "gsam", "rho": 0.1, "alpha": 0.4, "rho_min": 0.02, "lr_max": 0.05, "lr_min": 0.0}],
        ("GSAM", {"alpha": 0.4, "rho": (0.1, 0.02)}),
        True,
    ),
    "gsam_constant_rho": (
        [{"name": "gsam", "rho": 0.1, "alpha": 0.3}],
        ("GSAM", {"alpha": 0.3, "rho": (0.1, 0.1)}),
        False,
    ),
    "wsam": ([{"name": "wsam", "rho": 0.1, "gamma": 0.9}], ("WSAM", {"rho": 0.1, "gamma": 0.9}), True),
    "wsam_coupled": (
        [{"name": "wsam", "rho": 0.1, "gamma": 0.8, "decouple": False}],
        ("WSAM", {"rho": 0.1, "gamma": 0.8, "decouple": False}),
        False,
    ),
    "looksam": (
        [{"name": "looksam", "rho": 0.1, "k": 3, "alpha": 0.7}],
        ("LookSAM", {"rho": 0.1, "k": 3, "alpha": 0.7}),
        False,
    ),
    "looksam_gc": (
        ["centralize", {"name": "looksam", "rho": 0.1, "k": 4, "alpha": 0.5}],
        ("LookSAM", {"rho": 0.1, "k": 4, "alpha": 0.5, "use_gc": True}),
        False,
    ),
    "friendly_sam": (
        [{"name": "friendly_sam", "rho": 0.1, "sigma": 1.0, "lmbda": 0.9}],
        ("FriendlySAM", {"rho": 0.1, "sigma": 1.0, "lmbda": 0.9}),
        False,
    ),
    "friendly_sam_half": (
        [{"name": "friendly_sam", "rho": 0.1, "sigma": 0.5, "lmbda": 0.6}],
        ("FriendlySAM", {"rho": 0.1, "sigma": 0.5, "lmbda": 0.6}),
        False,
    ),
}


def _cosine(opt):
    return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS)


def _peer(case: str, model_name: str):
    """The library's run of ``case``: the model after STEPS steps."""
    po = pytest.importorskip("pytorch_optimizer", reason="pytorch-optimizer is a test dependency")
    _, (cls, kwargs), scheduled = CASES[case]
    model, (x, y) = build(model_name), data(model_name)

    def loss_fn():
        return F.cross_entropy(model(x), y)

    if cls == "GSAM":
        base = torch.optim.SGD(model.parameters(), **SGD)
        sched = _cosine(base) if scheduled else torch.optim.lr_scheduler.ConstantLR(base, factor=1.0)
        rho_max, rho_min = kwargs["rho"]
        rho = po.ProportionScheduler(sched, max_lr=SGD["lr"], min_lr=0.0, max_value=rho_max, min_value=rho_min)
        opt = po.GSAM(model.parameters(), base, model, rho, alpha=kwargs["alpha"])
        gsam_steps(opt, x, y, STEPS, sched)
    elif cls == "WSAM":
        opt = po.WSAM(model, model.parameters(), torch.optim.SGD, **kwargs, **SGD)
        sched = _cosine(opt.base_optimizer) if scheduled else None
        for _ in range(STEPS):
            wsam_steps(opt, loss_fn, 1)
            if sched is not None:
                sched.step()
    else:
        opt = getattr(po, cls)(model.parameters(), torch.optim.SGD, **kwargs, **SGD)
        closure_steps(opt, model, loss_fn, STEPS)
    return model


def _ours(case: str, model_name: str, transforms=None):
    rules_, _, scheduled = CASES[case]
    model, (x, y) = build(model_name), data(model_name)
    opt = torch.optim.SGD(model.parameters(), **SGD)
    sched = _cosine(opt) if scheduled else None
    hooks = H.attach(model, _rule(*(transforms or rules_)))
    hooks.stage("sharpness").set_optimizer(opt)

    def loss_fn():
        return F.cross_entropy(model(x), y)

    for _ in range(STEPS):
        opt.zero_grad()
        hooks.backward(loss_fn(), closure=loss_fn)
        hooks.after_backward()
        opt.step()
        if sched is not None:
            sched.step()
    hooks.remove()
    return model


def _gap(a, b) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("model_name", ["cnn", "transformer"])
@pytest.mark.parametrize("case", list(CASES))
def test_equals_pytorch_optimizer_float64(case, model_name, monkeypatch):
    monkeypatch.setattr("pytorch_optimizer.optimizer.sam.get_global_gradient_norm", norm_in_dtype)
    ref, ours = _peer(case, model_name), _ours(case, model_name)
    assert _gap(ours, ref) <= 1e-10, _gap(ours, ref)
    rho = next(t for t in CASES[case][0] if isinstance(t, dict))["rho"]
    sam = _ours(case, model_name, [{"name": "sam", "rho": rho}])
    assert _gap(ours, sam) > 1e-6  # the comparison can fail: the method is not plain SAM here
    if model_name == "cnn":  # BatchNorm: the running statistics of the first forwards only
        bn, bn_ref = ours[1], ref[1]
        assert torch.allclose(bn.running_mean, bn_ref.running_mean, rtol=0, atol=1e-10)
        assert torch.allclose(bn.running_var, bn_ref.running_var, rtol=0, atol=1e-10)
        assert bn.num_batches_tracked.item() == STEPS  # counted once per step
        assert bn_ref.num_batches_tracked.item() == 2 * STEPS  # the library's bypass counts the second forward
