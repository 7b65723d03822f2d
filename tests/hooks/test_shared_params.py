"""``@shared``: the parameters every task's loss reaches, found from one forward's autograd
graph, against the parameters each loss gives a gradient to (torch.autograd.grad)."""

from __future__ import annotations

import pytest
import torch
from helpers import ROOT, compose_config
from torch import nn

import gradmod
from gradmod.hooks.rules import shared as shared_params


class Fork(nn.Module):
    """A stem every task reads, a branch only tasks a and b read, a head per task, and a
    frozen layer: ``@shared`` is the stem alone."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 6))
        self.branch = nn.Linear(6, 6)
        self.frozen = nn.Linear(6, 6).requires_grad_(False)
        self.heads = nn.ModuleDict({t: nn.Linear(6, 2) for t in "abc"})

    def forward(self, x):
        h = self.frozen(self.stem(x))
        g = torch.relu(self.branch(h))
        return {"a": self.heads["a"](g), "b": self.heads["b"](g + h), "c": self.heads["c"](h)}


def _losses(model, x):
    return {t: out.square().mean() for t, out in model(x).items()}


def test_find_is_the_parameters_every_loss_gives_a_gradient_to():
    torch.manual_seed(0)
    model = Fork()
    losses = _losses(model, torch.randn(5, 4))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    each = [
        {n for (n, _), g in zip(named, torch.autograd.grad(loss, [p for _, p in named], retain_graph=True, allow_unused=True)) if g is not None}
        for loss in losses.values()
    ]  # fmt: skip
    want = [n for n, _ in named if all(n in e for e in each)]
    assert want == ["stem.0.weight", "stem.0.bias", "stem.2.weight", "stem.2.bias"]
    assert shared_params.find(model, losses) == want
    assert shared_params.find(model, losses["a"]) == sorted(each[0], key=[n for n, _ in named].index)  # one loss


def test_attach_selects_what_find_found_and_refuses_shared_where_no_forward_found_it():
    torch.manual_seed(0)
    rule = {"mtl": {"params": "@shared", "transforms": ["upgrad"]}}
    with pytest.raises(ValueError) as e:
        gradmod.attach(Fork(), rule)
    assert str(e.value).startswith("hooks.mtl.params: @shared (the parameters every task's loss reaches) is found")
    assert "gradmod.hooks.rules.shared.find(model, losses)" in str(e.value) and "\n" not in str(e.value)
    model = Fork()
    shared_params.find(model, _losses(model, torch.randn(5, 4)))
    with gradmod.attach(model, {**rule, "clip": {"params": "*", "exclude": "@shared", "transforms": ["zero"]}}) as h:
        chosen = {d["tensor"]: d["rule"] for d in h.describe()}
    assert [n for n, r in chosen.items() if r == "mtl"] == [
        "stem.0.weight",
        "stem.0.bias",
        "stem.2.weight",
        "stem.2.bias",
    ]
    assert {n for n, r in chosen.items() if r == "clip"} == {"branch.weight", "branch.bias"} | {
        f"heads.{t}.{w}" for t in "abc" for w in ("weight", "bias")
    }
    with pytest.raises(ValueError, match=r"^hooks.m.modules: @shared selects parameters; a modules rule"):
        gradmod.attach(model, {"m": {"modules": "@shared", "transforms": ["zero"]}})


def test_shared_matching_nothing_is_one_line():
    model = nn.ModuleDict({"a": nn.Linear(2, 1), "b": nn.Linear(2, 1)})
    x = torch.randn(3, 2)
    shared_params.find(model, {"a": model["a"](x).sum(), "b": model["b"](x).sum()})
    with pytest.raises(
        ValueError,
        match=r"^hooks.r.params: @shared matches no parameter .*: no trainable parameter is reached by every task's loss$",
    ):
        gradmod.attach(model, {"r": {"params": "@shared", "transforms": ["upgrad"]}})


SHIPPED = sorted(p.stem for p in (ROOT / "gradmod" / "conf" / "hooks").glob("*.yaml") if "@shared" in p.read_text())


def test_the_shipped_per_loss_files_select_multi_lenets_trunk():
    from gradmod.hooks.rules.targets import load_rules
    from gradmod.models import MultiLeNet

    assert len(SHIPPED) == 21 and "pcgrad" in SHIPPED and "krum" in SHIPPED  # every gradient method
    model = MultiLeNet()
    shared_params.find(model, {t: out.sum() for t, out in model(torch.randn(2, 1, 36, 36)).items()})
    trunk = [n for n, _ in model.named_parameters() if n.startswith("trunk.")]
    for name in SHIPPED:
        with gradmod.attach(model, load_rules(name)) as hooks:
            assert [d["tensor"] for d in hooks.describe()] == trunk, name


@pytest.mark.slow
def test_the_shipped_per_loss_files_select_the_shared_parameters_bitwise_as_trunk_did(tmp_path):
    """The trainer finds @shared from the forward it checks the model with (the random state
    put back): multi_lenet's trunk, and the run is bitwise the one that names ``trunk.*``."""
    from gradmod.app.cli import run

    tiny = ["data=multi_mnist", "data.batch_size=1000", "data.n_test=100", "trainer.epochs=1", "trainer.device=cpu"]
    tiny += ["trainer.progress=false", "trainer.threads=1", "model=multi_lenet", "+hooks=pcgrad"]
    cfg = compose_config(*tiny)
    assert cfg.hooks.pcgrad.params == "@shared"
    run(cfg, tmp_path / "shared")
    run(compose_config(*tiny, "hooks.pcgrad.params=trunk.*"), tmp_path / "trunk")
    a, b = (torch.load(tmp_path / name / "model.pt") for name in ("shared", "trunk"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    plan = (tmp_path / "shared" / "hook_plan.json").read_text()
    assert (
        plan.count('"rule": "pcgrad"') == 6
        and '"tensor": "trunk.fc.bias"' in plan
        and "left." not in plan.split('"rule": "pcgrad"')[-1].split("}")[0]
    )
