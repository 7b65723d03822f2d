"""``optimizer.layer_decay`` against timm's ``create_optimizer_v2(model, layer_decay=...)`` (its
groups read from its own ``group_matcher()``), and ``@no_weight_decay`` against the model's own
``no_weight_decay()``."""

from __future__ import annotations

import copy
import types

import pytest
import torch
from helpers import TINY_FAKE, compose_config

import gradmod
from gradmod.app.config_store import validate
from gradmod.hooks.rules.globs import param_kinds, select
from gradmod.models import MnistCNN, TinyGPT
from gradmod.optim.param_groups import describe
from gradmod.run import runner
from gradmod.run.folder import endings

timm = pytest.importorskip("timm")
timm_optim = pytest.importorskip("timm.optim")
timm_scheduler = pytest.importorskip("timm.scheduler")

LR, WD, DECAY = 1e-3, 0.05, 0.75
SPEC = {
    "_target_": "torch.optim.AdamW",
    "lr": LR,
    "weight_decay": WD,
    "layer_decay": DECAY,
    "no_decay": ["@vectors", "@no_weight_decay"],  # timm's rule: ndim <= 1 or the model's no_weight_decay()
}


def vit():
    torch.manual_seed(0)  # ViT-tiny (12 blocks of width 192) on 32x32 images: the same groups, a fast step
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, num_classes=10)


def torchvision_resnet():
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    # timm reads a torchvision ResNet as one layer; give it timm's own ResNet matcher (the names are the same)
    model.group_matcher = types.MethodType(timm.models.resnet.ResNet.group_matcher, model)
    return model


def spec_for(model):
    """timm's weight-decay rule: ``ndim <= 1``, and the model's own ``no_weight_decay()`` where it has one."""
    return SPEC if hasattr(model, "no_weight_decay") else {**SPEC, "no_decay": ["@vectors"]}


def per_parameter(model, opt, lr_of=lambda g: g["lr"]):
    """Parameter name -> (lr, weight decay) of the group that holds it."""
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: (lr_of(g), g["weight_decay"]) for g in opt.param_groups for p in g["params"]}


def timms(model):
    opt = timm_optim.create_optimizer_v2(model, "adamw", lr=LR, weight_decay=WD, layer_decay=DECAY)
    # timm's scheduler writes lr x lr_scale into each group (here a constant rate)
    sched = timm_scheduler.StepLRScheduler(opt, decay_t=1000)
    return opt, sched


@pytest.mark.parametrize("make", [vit, torchvision_resnet, lambda: timm.create_model("resnet18", num_classes=10)])
def test_groups_equal_timms(make):
    model = make()
    mine = gradmod.optimizer(model, spec_for(model))
    other = copy.deepcopy(model)
    theirs, _ = timms(other)
    assert len(mine.param_groups) == len(theirs.param_groups)
    assert per_parameter(model, mine) == per_parameter(other, theirs)
    # and a parameter's rate is lr x decay ** (top - depth), timm's lr_scale
    ours = per_parameter(model, mine)
    assert len({lr for lr, _ in ours.values()}) == max(g["depth"] for g in mine.param_groups) + 1


@pytest.mark.parametrize("make", [vit, torchvision_resnet])
def test_five_adamw_steps_equal_timms_bitwise(make):
    model = make()
    other = copy.deepcopy(model)
    mine = gradmod.optimizer(model, spec_for(model))
    theirs, sched = timms(other)
    torch.manual_seed(1)
    for step in range(5):
        x, y = torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,))
        for net, opt in ((model, mine), (other, theirs)):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(net(x), y).backward()
            opt.step()
        sched.step(step + 1)
    for (n, a), (_, b) in zip(model.named_parameters(), other.named_parameters()):
        assert torch.equal(a, b), n


def test_depths_read_from_the_names_of_a_transformer():
    model = TinyGPT(65)
    opt = gradmod.optimizer(model, {"_target_": "torch.optim.AdamW", "lr": 0.01, "layer_decay": 0.5})
    depth = {n: g["depth"] for n, g in per_group(model, opt).items()}
    blocks = sorted({n.split(".")[1] for n in depth if n.startswith("blocks.")}, key=int)
    for n, d in depth.items():
        if n.startswith("blocks."):
            assert d == 1 + blocks.index(n.split(".")[1])
        elif n.startswith(("embed", "position")):
            assert d == 0
        elif n.startswith("head"):
            assert d == len(blocks) + 1
        else:  # the final norm, after the last block: with it, as timm puts a ViT's
            assert d == len(blocks), n
    top = len(blocks) + 1
    for n, g in per_group(model, opt).items():
        assert g["lr"] == 0.01 * 0.5 ** (top - depth[n])


def per_group(model, opt):
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: g for g in opt.param_groups for p in g["params"]}


def test_it_combines_with_groups_and_no_decay_and_own_optimizers():
    model = TinyGPT(65)
    spec = {
        "_target_": "torch.optim.AdamW",
        "lr": 0.01,
        "weight_decay": 0.1,
        "layer_decay": 0.5,
        "no_decay": ["@vectors"],
        "groups": [
            {"params": "@embeddings", "lr_scale": 0.1},
            {"params": "@matrices", "optimizer": {"_target_": "torch.optim.SGD", "lr": 0.2}},
        ],
    }
    opt = gradmod.optimizer(model, spec)
    plain = per_group(model, gradmod.optimizer(model, {**spec, "layer_decay": None}))
    decayed = per_group(model, gradmod.optimizer(model, {**spec, "layer_decay": 0.5}))
    top = max(g["depth"] for g in decayed.values())
    for n, g in decayed.items():  # each parameter: its rate without layer_decay, times the decay of its depth
        assert g["lr"] == plain[n]["lr"] * 0.5 ** (top - g["depth"])
        assert g["weight_decay"] == plain[n]["weight_decay"]
    assert type(opt).__name__ == "CombinedOptimizer"
    line = describe(model, opt, True)
    assert f"depth 0 AdamW lr={0.01 * 0.1 * 0.5**top:g} weight_decay=0.1: embed.weight, position.weight" in line


def test_the_list_form_gives_depths_where_names_do_not():
    model = MnistCNN(1, 10)
    spec = {
        "_target_": "torch.optim.SGD",
        "lr": 0.1,
        "layer_decay": {"factor": 0.5, "depths": ["conv1.*", "conv2.*", "l1.*"]},
    }
    lrs = {n: g["lr"] for n, g in per_group(model, gradmod.optimizer(model, spec)).items()}
    assert lrs == {
        "conv1.weight": 0.025,
        "conv1.bias": 0.025,
        "conv2.weight": 0.05,
        "conv2.bias": 0.05,
        "l1.weight": 0.1,
        "l1.bias": 0.1,
    }


@pytest.mark.parametrize(
    ("value", "line"),
    [
        (0, r"^optimizer.layer_decay: 0 must be a number in \(0, 1\]"),
        (1.5, r"^optimizer.layer_decay: 1.5 must be a number in \(0, 1\]"),
        ("x", r"^optimizer.layer_decay: 'x' must be a number in \(0, 1\]"),
        ({"factor": 2, "depths": ["*"]}, r"^optimizer.layer_decay.factor: 2 must be a number in \(0, 1\]"),
        (
            {"depths": ["*"]},
            r"^optimizer.layer_decay: .* must be a number in \(0, 1\] or a mapping with factor and depths",
        ),
        (
            0.5,
            r"^optimizer.layer_decay: no parameter name tells its depth .* among conv1.weight, conv1.bias, conv2.weight, conv2.bias, l1.weight, l1.bias; give the depths as globs, shallowest first: optimizer.layer_decay=\{factor: 0.75, depths:",
        ),
        ({"factor": 0.5, "depths": ["conv*"]}, r"^optimizer.layer_decay.depths: l1.weight, l1.bias in no depth"),
        (
            {"factor": 0.5, "depths": ["conv*", "fc.*"]},
            r"^optimizer.layer_decay.depths.1: 'fc.\*' matches no parameter",
        ),
    ],
)
def test_bad_layer_decay_is_one_line(value, line):
    with pytest.raises(ValueError, match=line) as e:
        gradmod.optimizer(MnistCNN(1, 10), {"_target_": "torch.optim.SGD", "lr": 0.1, "layer_decay": value})
    assert "\n" not in str(e.value)


def test_a_bad_factor_from_the_command_line_is_one_line_and_exit_2(tmp_path):
    cfg = compose_config(*TINY_FAKE, "optimizer.layer_decay=1.5")
    ending = runner.execute(lambda: validate(cfg), tmp_path / "run")
    assert ending.status == "failed" and ending.exit_code == 2
    line = endings.message(ending.error)
    assert "\n" not in line and line.startswith("optimizer.layer_decay: 1.5 must be a number in (0, 1]")


def test_no_weight_decay_selects_the_models_own_names():
    model = vit()
    names = [n for n, _ in model.named_parameters()]
    own = sorted(n for n in names if n in model.no_weight_decay())
    assert own == ["cls_token", "pos_embed"]
    assert sorted(select("r", {"params": "@no_weight_decay"}, names, "parameter", param_kinds(model))) == own
    # in a group entry, as in a rule
    opt = gradmod.optimizer(
        model, {"_target_": "torch.optim.AdamW", "groups": [{"params": "@no_weight_decay", "lr": 0.5}]}
    )
    assert sorted(n for n, g in per_group(model, opt).items() if g["lr"] == 0.5) == own
    with pytest.raises(
        ValueError,
        match=r"^optimizer.no_decay: '@no_weight_decay' matches no parameter; the model has no no_weight_decay\(\) method",
    ):
        gradmod.optimizer(MnistCNN(1, 10), {"_target_": "torch.optim.AdamW", "no_decay": ["@no_weight_decay"]})


def test_vectors_in_a_group_entry():
    model = TinyGPT(65)
    opt = gradmod.optimizer(model, {"_target_": "torch.optim.AdamW", "groups": [{"params": "@vectors", "lr": 0.5}]})
    chosen = sorted(n for n, g in per_group(model, opt).items() if g["lr"] == 0.5)
    assert chosen == sorted(n for n, p in model.named_parameters() if p.ndim <= 1)
