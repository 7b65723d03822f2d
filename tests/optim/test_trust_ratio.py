"""``trust_ratio`` by group and the ``optimizer=lars`` / ``optimizer=lamb`` presets, against
pytorch-optimizer's ``LARS`` and ``Lamb`` and a hand-written LARC (apex's wrapper, written out)."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import compose_config
from torch import nn

import gradmod
from gradmod.app.config_store import validate
from gradmod.run.factories import optimizer_spec

po = pytest.importorskip("pytorch_optimizer", reason="pytorch-optimizer is a test dependency")
STEPS, TOLERANCE = 10, 1e-6


def resnet():
    torchvision = pytest.importorskip("torchvision")
    return torchvision.models.resnet18(num_classes=10)


def transformer_layer():
    return nn.Sequential(
        nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, dropout=0.0, batch_first=True),
        nn.Flatten(),
        nn.Linear(8 * 32, 10),
    )


def batch(make, generator):
    # batch 4: on 2 examples the last BatchNorm (1x1 maps) divides by a variance near 0, where a
    # rounding difference of 1e-16 grows to 1e-2 in 10 steps, whichever optimizer steps
    if make is resnet:
        return torch.randn(4, 3, 32, 32, dtype=torch.float64, generator=generator)
    return torch.randn(4, 8, 32, dtype=torch.float64, generator=generator)


def preset(*overrides):
    return optimizer_spec(validate(compose_config(*overrides)).optimizer)


def trained_alike(make, spec, reference):
    """Both models after ``STEPS`` float64 steps on the same batches: the largest difference."""
    torch.manual_seed(0)
    model = make().double()
    other = copy.deepcopy(model)
    mine, theirs = gradmod.optimizer(model, spec), reference(other)
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        x, y = batch(make, g), torch.randint(0, 10, (4,), generator=g)
        for net, opt in ((model, mine), (other, theirs)):
            opt.zero_grad()
            nn.functional.cross_entropy(net(x), y).backward()
            opt.step()
    moved = max((a - b).abs().max().item() for a, b in zip(model.parameters(), make().double().parameters()))
    assert moved > 1e-4  # the steps did move the weights
    return max((a - b).abs().max().item() for a, b in zip(model.parameters(), other.parameters()))


@pytest.mark.parametrize("make", [pytest.param(resnet, marks=pytest.mark.slow), transformer_layer])
@pytest.mark.parametrize("wd", [None, 0.01])
def test_lars_is_pytorch_optimizers_lars(make, wd):
    overrides = ["optimizer=lars"] + ([f"optimizer.groups.0.trust_ratio.weight_decay={wd}"] if wd else [])
    spec = preset(*overrides)
    tr = spec["groups"][0]["trust_ratio"]
    assert tr == {"eta": 0.001, "mode": "scale", "weight_decay": wd or 1e-6}

    def reference(model):
        return po.LARS(
            model.parameters(),
            lr=spec["lr"],
            momentum=spec["momentum"],
            weight_decay=tr["weight_decay"],
            trust_coefficient=tr["eta"],
        )

    assert trained_alike(make, spec, reference) <= TOLERANCE


@pytest.mark.parametrize("make", [pytest.param(resnet, marks=pytest.mark.slow), transformer_layer])
def test_lamb_is_pytorch_optimizers_lamb(make):
    spec = preset("optimizer=lamb")

    def reference(model):  # LAMB leaves vectors out of the ratio and the decay: pytorch-optimizer's adam=True
        matrices = [p for p in model.parameters() if p.ndim > 1]
        vectors = [p for p in model.parameters() if p.ndim <= 1]
        groups = [{"params": matrices}, {"params": vectors, "weight_decay": 0.0, "adam": True}]
        return po.Lamb(groups, lr=spec["lr"], weight_decay=spec["weight_decay"], eps=spec["eps"], adam_debias=True)

    assert trained_alike(make, spec, reference) <= TOLERANCE


def test_larc_clip_mode_is_apexs_larc_by_hand():
    """apex's LARC around SGD: ``min(eta ||w|| / (||g|| + wd ||w|| + eps) / lr, 1)`` times ``g + wd w``."""
    eta, wd, eps, lr = 0.02, 5e-4, 1e-8, 0.5
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).double()
    other = copy.deepcopy(model)
    spec = {
        "_target_": "torch.optim.SGD",
        "lr": lr,
        "momentum": 0.9,
        "groups": [{"params": "*.weight", "trust_ratio": {"eta": eta, "mode": "clip", "weight_decay": wd, "eps": eps}}],
    }
    mine, sgd = gradmod.optimizer(model, spec), torch.optim.SGD(other.parameters(), lr=lr, momentum=0.9)
    for _ in range(STEPS):
        x, y = torch.randn(4, 6, dtype=torch.float64), torch.randint(0, 3, (4,))
        for net in (model, other):
            net.zero_grad()
            nn.functional.cross_entropy(net(x), y).backward()
        mine.step()
        with torch.no_grad():
            for name, p in other.named_parameters():
                if name.endswith("weight"):
                    w, g = p.norm(), p.grad.norm()
                    ratio = min((eta * w / (g + w * wd + eps) / lr).item(), 1.0)
                    p.grad.add_(p, alpha=wd).mul_(ratio)
        sgd.step()
    assert max((a - b).abs().max().item() for a, b in zip(model.parameters(), other.parameters())) <= 1e-12


def test_the_presets_print_their_groups():
    from gradmod.models import MnistCNN
    from gradmod.optim.param_groups import describe

    model = MnistCNN(1, 10)
    opt = gradmod.optimizer(model, preset("optimizer=lars"))
    assert [g.get("trust_ratio") is not None for g in opt.param_groups] == [False, True]
    line = describe(model, opt, True)
    assert "SGD lr=0.1 weight_decay=0: conv1.bias, conv2.bias, l1.bias" in line


@pytest.mark.parametrize(
    ("trust", "line"),
    [
        ({"mode": "lars"}, r"^optimizer.groups.0.trust_ratio.mode: 'lars'; allowed: scale, clip$"),
        ({"of": "weights"}, r"^optimizer.groups.0.trust_ratio.of: 'weights'; allowed: grad, update$"),
        ({"eta": 0}, r"^optimizer.groups.0.trust_ratio.eta: 0 must be a finite number > 0$"),
        ({"trust": 1}, r"^optimizer.groups.0.trust_ratio.trust: trust_ratio takes no 'trust'; it takes eta, mode, of"),
        ({"of": "update", "weight_decay": 0.1}, r"^optimizer.groups.0.trust_ratio.weight_decay: LARS's decay inside"),
        ("yes", r"^optimizer.groups.0.trust_ratio: 'yes' must be true or a mapping with eta, mode"),
    ],
)
def test_a_bad_trust_ratio_is_one_line(trust, line):
    from gradmod.models import MnistCNN

    spec = {"_target_": "torch.optim.SGD", "lr": 0.1, "groups": [{"params": "*.weight", "trust_ratio": trust}]}
    with pytest.raises(ValueError, match=line) as e:
        gradmod.optimizer(MnistCNN(1, 10), spec)
    assert "\n" not in str(e.value)


def test_trust_ratio_on_no_parameter_is_one_line():
    model = nn.Sequential(nn.LayerNorm(4))  # vectors only: lars's trust group is empty
    with pytest.raises(ValueError, match=r"^optimizer.groups.0: exclude removes every parameter .*selected$"):
        gradmod.optimizer(model, preset("optimizer=lars"))
    with pytest.raises(ValueError, match=r"^optimizer.groups.0.params: 'conv9.\*' matches no parameter"):
        gradmod.optimizer(
            model, {"_target_": "torch.optim.SGD", "groups": [{"params": "conv9.*", "trust_ratio": True}]}
        )


def test_adam_without_bias_correction_keeps_torchs_step_count():
    p = nn.Parameter(torch.ones(3))
    opt = gradmod.optim.Adam([p], lr=0.1, bias_correction=False)
    for _ in range(3):
        p.grad = torch.full((3,), 2.0)
        opt.step()
    state = opt.state[p]
    assert state["step"].item() == 3
    m, v = state["exp_avg"], state["exp_avg_sq"]  # the step is m / (sqrt(v) + eps), not bias-corrected
    assert torch.allclose(m, torch.full((3,), 2.0 * (1 - 0.9**3))) and torch.allclose(
        v, torch.full((3,), 4.0 * (1 - 0.999**3))
    )
