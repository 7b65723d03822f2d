"""``@last_layer``: the classifier of any model that registers it last, so the shipped agc
rule leaves it out on every model; checked against timm's own ``get_classifier()``."""

from __future__ import annotations

import pytest
import torch
from helpers import CONF, run_train, tiny_mlp
from torch import nn

from gradmod.hooks import attach, load_rules
from gradmod.models import build_model

AGC = load_rules(CONF / "hooks" / "agc.yaml")


def clipped(model: nn.Module, rules=AGC) -> list[str]:
    with attach(model, rules) as hooks:
        return [row["tensor"] for row in hooks.describe()]


def params_of(model: nn.Module, module: nn.Module) -> list[str]:
    own = {id(p) for p in module.parameters()}
    return [n for n, p in model.named_parameters() if id(p) in own]


@pytest.mark.parametrize(
    "model,head",
    [
        (tiny_mlp(4, 8, 8, 3), "4"),
        (build_model("mnist_cnn"), "l1"),
        (build_model("resnet18", num_classes=10), "fc"),
    ],
)
def test_the_agc_rule_leaves_out_the_classifier(model, head):
    names = [n for n, _ in model.named_parameters()]
    assert clipped(model) == [n for n in names if not n.startswith(head + ".")]


def test_last_layer_selects_too_and_takes_its_own_parameters_only():
    model = nn.Sequential(nn.Linear(3, 4), nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2, bias=False)))
    rules = {"head": {"params": "@last_layer", "transforms": ["zero"]}}
    assert clipped(model, rules) == ["1.1.weight"]


def test_last_layer_in_a_modules_rule_is_one_line():
    with pytest.raises(ValueError, match=r"^hooks.r.modules: @last_layer selects parameters; a modules rule"):
        attach(tiny_mlp(3, 2), {"r": {"modules": "@last_layer", "transforms": ["zero"]}})


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", ["resnet10t", "vit_tiny_patch16_224", "efficientnet_b0", "convnext_atto", "mobilenetv3_small_050"]
)
def test_last_layer_is_timms_classifier(name):
    timm = pytest.importorskip("timm")
    model = timm.create_model(name, pretrained=False, num_classes=10)
    head = params_of(model, model.get_classifier())
    assert clipped(model, {"head": {"params": "@last_layer", "transforms": ["zero"]}}) == head
    assert set(clipped(model)) == {n for n, _ in model.named_parameters()} - set(head)


@pytest.mark.slow
def test_agc_sweeps_a_users_model_and_a_failing_job_is_one_line(tmp_path):
    """The shipped agc file on a model of the user's; the job whose loss raises prints one
    line, its traceback is in its own train.log."""
    proc = run_train(
        tmp_path,
        "data=fake",
        "data.image_size=28",
        "data.channels=1",
        "data.train_size=40",
        "data.test_size=20",
        "data.batch_size=10",
        "trainer.epochs=1",
        "trainer.device=cpu",
        "trainer.progress=false",
        "trainer.threads=1",
        "model._target_=tests.support.sweep_models.mlp",
        "+hooks=agc",
        "loss._target_=torch.nn.CrossEntropyLoss,tests.support.user_objects.LossThatRaises",
        multirun=True,
        check=False,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "Traceback" not in out, out
    failed = [ln for ln in out.splitlines() if "loss went wrong" in ln]
    assert len(failed) == 2, out  # the job's line as it ends, and the sweep's closing line
    assert "job 1 failed: ValueError: loss went wrong" in failed[0]
    assert failed[1].startswith("error: 1 of 2 jobs did not end ok")
    assert "Traceback" in (tmp_path / "1" / "train.log").read_text()
    assert torch.load(tmp_path / "0" / "model.pt", weights_only=True)  # the agc job trained
