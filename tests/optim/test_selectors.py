"""The selectors (@embeddings, @norms, @biases, @vectors, @matrices, @last_layer) on a
transformer and a CNN, read from the module types and shapes; in optimizer groups and in hook
rules alike."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradmod
from gradmod.hooks.rules.globs import param_kinds, select
from gradmod.models import MnistCNN, TinyGPT

WHAT = "parameter"


def names_of(model, selector):
    names = [n for n, _ in model.named_parameters()]
    return select("r", {"params": selector}, names, WHAT, param_kinds(model))


def by_hand(model, keep):
    """The names ``keep(module, short_name, parameter)`` picks, walking the modules."""
    return [
        f"{m}.{n}" if m else n
        for m, module in model.named_modules()
        for n, p in module.named_parameters(recurse=False)
        if keep(module, n, p)
    ]


def test_selectors_on_the_tiny_transformer():
    model = TinyGPT(65)
    assert names_of(model, "@embeddings") == ["embed.weight", "position.weight"]
    assert names_of(model, "@norms") == by_hand(model, lambda m, n, p: isinstance(m, nn.LayerNorm))
    assert len(names_of(model, "@norms")) == 10  # two per block, the final norm: weight and bias each
    assert names_of(model, "@biases") == [n for n, _ in model.named_parameters() if n.endswith(".bias")]
    assert names_of(model, "@last_layer") == ["head.weight", "head.bias"]
    matrices = by_hand(model, lambda m, n, p: isinstance(m, nn.Linear) and n == "weight")
    assert names_of(model, "@matrices") == [n for n in matrices if n != "head.weight"]
    assert len(names_of(model, "@matrices")) == 12  # q, k, v, out, fc1, fc2 in each of two blocks


def test_selectors_on_the_cnn():
    model = MnistCNN(1, 10)
    assert names_of(model, "@matrices") == ["conv1.weight", "conv2.weight"]  # kernels; l1 is the last layer
    assert names_of(model, "@biases") == ["conv1.bias", "conv2.bias", "l1.bias"]
    assert names_of(model, ["@matrices", "@last_layer"]) == ["conv1.weight", "conv2.weight", "l1.weight", "l1.bias"]
    with pytest.raises(ValueError, match=r"hooks.r.params: '@norms' matches no parameter; the model has none"):
        names_of(model, "@norms")
    bn = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.Flatten(), nn.Linear(2, 3))
    assert names_of(bn, "@norms") == ["1.weight", "1.bias"]
    assert names_of(bn, "@matrices") == ["0.weight"]


class LayerScaleBlock(nn.Module):
    """A residual block with a layer-scale ``gamma`` (CaiT, ConvNeXt): a 1-D parameter that
    neither a norm nor a bias holds."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(4)
        self.fc = nn.Linear(4, 4)
        self.gamma = nn.Parameter(torch.full((4,), 1e-5))

    def forward(self, x):
        return x + self.gamma * self.fc(self.norm(x))


def test_vectors_are_every_parameter_of_one_dimension_or_none():
    model = nn.Sequential(LayerScaleBlock(), nn.Linear(4, 2))
    model.register_parameter("temperature", nn.Parameter(torch.tensor(1.0)))
    assert names_of(model, "@vectors") == [n for n, p in model.named_parameters() if p.ndim <= 1]
    shown = ["temperature", "0.gamma", "0.norm.weight", "0.norm.bias", "0.fc.bias", "1.bias"]
    assert names_of(model, "@vectors") == shown
    assert "0.gamma" not in names_of(model, ["@biases", "@norms"])  # what @vectors adds for a no_decay rule


def test_vectors_as_no_decay_are_timms_weight_decay_groups():
    """``no_decay: ["@vectors"]`` splits a layer-scale ConvNeXt as timm's ``param_groups_weight_decay`` does
    (``ndim <= 1 or name.endswith(".bias")``), its ``gamma``s with the biases and norms."""
    timm = pytest.importorskip("timm")
    from timm.optim import param_groups_weight_decay

    model = timm.create_model("convnext_atto", pretrained=False, num_classes=10, ls_init_value=1e-6)
    assert any(n.endswith(".gamma") for n, _ in model.named_parameters())
    spec = {"_target_": "torch.optim.AdamW", "lr": 1e-3, "weight_decay": 0.05, "no_decay": ["@vectors"]}
    ours = [({id(p) for p in g["params"]}, g["weight_decay"]) for g in gradmod.optimizer(model, spec).param_groups]
    theirs = [({id(p) for p in g["params"]}, g["weight_decay"]) for g in param_groups_weight_decay(model, 0.05)]
    assert sorted(ours, key=lambda g: g[1]) == sorted(theirs, key=lambda g: g[1])
    with gradmod.attach(model, {"v": {"params": "@vectors", "transforms": ["zero"]}}) as hooks:
        chosen = {d["tensor"] for d in hooks.describe()}
    vectors = {n for n, p in model.named_parameters() if p.ndim <= 1 or n.endswith(".bias")}
    assert chosen == vectors  # a rule selects the same parameters


def test_a_librarys_own_norm_class_is_a_norm():
    class LlamaRMSNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(4))

    model = nn.ModuleDict({"norm": LlamaRMSNorm(), "proj": nn.Linear(4, 4), "head": nn.Linear(4, 2)})
    assert names_of(model, "@norms") == ["norm.weight"]


def test_selector_errors_are_one_line():
    model = TinyGPT(65)
    with pytest.raises(ValueError, match=r"'@norm' is not a selector; allowed: @last_layer, @embeddings, @norms"):
        names_of(model, "@norm")
    names = [n for n, _ in model.named_modules() if n]
    with pytest.raises(ValueError, match=r"hooks.r.modules: @norms selects parameters"):
        select("r", {"modules": "@norms"}, names, "module", param_kinds(model))
    with pytest.raises(ValueError, match=r"@matrices needs the model's module types"):
        select("r", {"params": "@matrices"}, [n for n, _ in model.named_parameters()], WHAT)


@pytest.mark.parametrize(
    ("model", "selector"), [(TinyGPT(65), "@norms"), (TinyGPT(65), "@matrices"), (MnistCNN(1, 10), "@matrices")]
)
def test_a_hook_rule_on_a_selector_touches_exactly_its_parameters(model, selector):
    """A rule that zeroes the gradients of ``params: selector`` leaves every other gradient as it was."""
    torch.manual_seed(0)
    x = torch.randint(0, 65, (2, 8)) if isinstance(model, TinyGPT) else torch.randn(2, 1, 28, 28)
    model(x).float().square().mean().backward()
    plain = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    with gradmod.attach(model, {"z": {"params": selector, "transforms": ["zero"]}}) as hooks:
        model(x).float().square().mean().backward()
        chosen = {d["tensor"] for d in hooks.describe()}
    assert chosen == set(names_of(model, selector))
    for n, p in model.named_parameters():
        if n in chosen:
            assert not p.grad.any(), n
        else:
            assert torch.equal(p.grad, plain[n]), n
