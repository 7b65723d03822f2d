"""optimizer.groups: entries by glob and selector become torch parameter groups, equal to the
ones written by hand; lr_scale follows an LR scheduler; bad entries are one line each."""

from __future__ import annotations

import math
import sys

import pytest
import torch
from helpers import TINY_FAKE, compose_config
from torch import nn

import gradmod
from gradmod.app.cli import describe
from gradmod.app.config_store import validate
from gradmod.models import MnistCNN, TinyGPT
from gradmod.run import runner
from gradmod.run.folder import endings
from gradmod.run.resume import apply_optimizer

ADAMW = {"_target_": "torch.optim.AdamW", "lr": 1e-3, "weight_decay": 0.1}


def batch(seed):
    return torch.randint(0, 65, (4, 12), generator=torch.Generator().manual_seed(seed))


def train(model, opt, steps=3, sched=None):
    for i in range(steps):
        opt.zero_grad(set_to_none=True)
        out = model(batch(i))
        nn.functional.cross_entropy(out, batch(100 + i)).backward()  # out: batch x classes x positions
        opt.step()
        if sched is not None:
            sched.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_groups_equal_the_same_groups_by_hand():
    torch.manual_seed(0)
    model = TinyGPT(65)
    twin = TinyGPT(65)
    twin.load_state_dict(model.state_dict())
    spec = {
        **ADAMW,
        "groups": [
            {"params": "@norms", "weight_decay": 0.0},
            {"params": "@embeddings", "lr_scale": 0.1},
            {"params": "blocks.0.*", "exclude": "@norms", "betas": [0.8, 0.9]},
        ],
    }
    opt = gradmod.optimizer(model, spec)
    named = dict(twin.named_parameters())
    norms = [n for n in named if ".norm" in n or n.startswith("norm.")]
    embeddings = ["embed.weight", "position.weight"]
    block0 = [n for n in named if n.startswith("blocks.0.") and n not in norms]
    rest = [n for n in named if n not in norms + embeddings + block0]
    by_hand = torch.optim.AdamW(
        [
            {"params": [named[n] for n in rest]},
            {"params": [named[n] for n in norms], "weight_decay": 0.0},
            {"params": [named[n] for n in embeddings], "lr": 1e-3 * 0.1},
            {"params": [named[n] for n in block0], "betas": (0.8, 0.9)},
        ],
        lr=1e-3,
        weight_decay=0.1,
    )
    assert type(opt) is torch.optim.AdamW  # no entry has its own optimizer: one torch optimizer
    for mine, theirs in zip(opt.param_groups, by_hand.param_groups, strict=True):
        assert names_in(model, mine) == names_in(twin, theirs)
        assert {k: mine[k] for k in theirs if k != "params"} == {k: v for k, v in theirs.items() if k != "params"}
    a, b = train(model, opt), train(twin, by_hand)
    assert all(torch.equal(a[n], b[n]) for n in a)


def names_in(model, group):
    """The group's parameters by name, in the group's order."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for p in group["params"]]


@pytest.mark.parametrize(
    "make",
    [
        lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)),
        lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5),
        lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=4),
    ],
)
def test_lr_scale_follows_the_scheduler(make):
    model = MnistCNN(1, 10)
    opt = gradmod.optimizer(model, {**ADAMW, "groups": [{"params": "@last_layer", "lr_scale": 0.25}]})
    sched = make(opt)
    for _ in range(4):
        base, scaled = (g["lr"] for g in opt.param_groups)
        assert scaled == pytest.approx(0.25 * base, rel=1e-12) and base > 0
        opt.step()
        sched.step()
    assert base != 1e-3  # the schedule moved


@pytest.mark.parametrize("own", [False, True])
def test_lr_scale_counts_once_under_a_timm_scheduler(own):
    """timm's schedulers multiply a group's ``lr_scale`` key into the rate they set: the group's
    rate is already scaled, so lr x s once, by the hand computation of the schedule."""
    timm_scheduler = pytest.importorskip("timm.scheduler")
    model = MnistCNN(1, 10)
    entry = {"params": "@last_layer", "lr_scale": 0.25}
    if own:
        entry["optimizer"] = {"_target_": "torch.optim.Adagrad"}  # its default lr, 0.01, scaled
    opt = gradmod.optimizer(model, {**ADAMW, "groups": [entry]})
    sched = timm_scheduler.CosineLRScheduler(opt, t_initial=8, warmup_t=2, warmup_lr_init=0.0)
    base = 0.01 if own else 1e-3
    for epoch in range(8):
        factor = epoch / 2 if epoch < 2 else 0.5 * (1 + math.cos(math.pi * epoch / 8))
        assert [g["lr"] for g in opt.param_groups] == pytest.approx([1e-3 * factor, 0.25 * base * factor], rel=1e-12)
        opt.step()
        sched.step(epoch + 1)


def test_every_parameter_is_held_and_a_frozen_one_does_not_move():
    """Frozen now (requires_grad False, .grad None): held, and AdamW's weight decay skips it."""
    model = MnistCNN(1, 10)
    model.conv1.requires_grad_(False)
    opt = gradmod.optimizer(model, {**ADAMW, "weight_decay": 0.5, "groups": [{"params": "conv*", "lr_scale": 2}]})
    held = {id(p) for g in opt.param_groups for p in g["params"]}
    assert held == {id(p) for p in model.parameters()}
    frozen = model.conv1.weight.detach().clone()
    for _ in range(2):
        opt.zero_grad(set_to_none=True)
        model(torch.randn(2, 1, 28, 28)).square().mean().backward()
        opt.step()
    assert model.conv1.weight.grad is None and torch.equal(model.conv1.weight, frozen)
    assert not torch.equal(model.conv2.weight, MnistCNN(1, 10).conv2.weight)


def test_no_decay_splits_each_entry_and_a_resume_keeps_the_markers():
    model = MnistCNN(1, 10)
    spec = {**ADAMW, "no_decay": ["@biases"], "groups": [{"params": "conv*", "lr_scale": 0.5, "betas": [0.8, 0.9]}]}
    opt = gradmod.optimizer(model, spec)
    shape = [(len(g["params"]), g["weight_decay"], g.get("no_decay", False)) for g in opt.param_groups]
    assert shape == [(1, 0.1, False), (1, 0.0, True), (2, 0.1, False), (2, 0.0, True)]
    opt.load_state_dict(opt.state_dict())  # as a checkpoint restores it: the markers come back
    apply_optimizer(
        opt, {"optimizer.lr": (1e-3, 2e-3), "optimizer.weight_decay": (0.1, 0.2), "optimizer.betas": ((), (0.7, 0.7))}
    )
    assert [g["lr"] for g in opt.param_groups] == [2e-3, 2e-3, 1e-3, 1e-3]  # the entry's: 0.5 x the new base
    assert [g["weight_decay"] for g in opt.param_groups] == [0.2, 0.0, 0.2, 0.0]
    assert [g["betas"] for g in opt.param_groups] == [(0.7, 0.7), (0.7, 0.7), (0.8, 0.9), (0.8, 0.9)]


def test_a_resume_leaves_an_entrys_own_optimizer_as_its_entry_set_it():
    model = TinyGPT(65)
    spec = {**ADAMW, "groups": [{"params": "@matrices", "optimizer": {"_target_": "gradmod.optim.Muon", "lr": 0.02}}]}
    opt = gradmod.optimizer(model, spec)
    apply_optimizer(opt, {"optimizer.lr": (1e-3, 5e-4), "optimizer.weight_decay": (0.1, 0.3)})
    assert [(g["lr"], g["weight_decay"]) for g in opt.param_groups] == [(5e-4, 0.3), (0.02, 0.1)]


@pytest.mark.parametrize(
    ("groups", "line"),
    [
        (
            [{"params": "conv*"}, {"params": "conv1.*"}],
            r"^optimizer.groups.1.params: conv1.weight is matched by optimizer.groups.0 too; .*exclude",
        ),
        ([{"params": "conv3.*"}], r"^optimizer.groups.0.params: 'conv3.\*' matches no parameter .*close names: conv"),
        ([{"params": "l1.*", "momentum": 0.9}], r"^optimizer.groups.0.momentum: AdamW takes no argument 'momentum'; "),
        ([{"params": "l1.*", "lr": 0.1, "lr_scale": 2}], r"^optimizer.groups.0: give lr or lr_scale, not both$"),
        ([{"params": "l1.*", "lr_scale": -1}], r"^optimizer.groups.0.lr_scale: -1 must be a finite number >= 0$"),
        (["l1.*"], r"^optimizer.groups.0: an entry is a mapping with params \(globs or selectors: @last_layer, "),
        (
            [{"params": "conv*", "exclude": "conv*"}],
            r"^optimizer.groups.0: exclude removes every parameter \(see model.named_parameters\(\)\) the rule",
        ),
        (
            [{"params": "l1.*", "optimizer": {"_target_": "torch.optim.SGD", "betas": [0.9, 0.9]}}],
            r"^optimizer.groups.0.optimizer.betas: SGD takes no argument 'betas'; it takes lr, momentum",
        ),
        (
            [{"params": "l1.*", "optimizer": {"_target_": "torch.optim.Nope"}}],
            r"^optimizer.groups.0.optimizer._target_='torch.optim.Nope' does not import",
        ),
        (
            [{"params": "l1.*", "optimizer": {"_target_": "torch.optim.Muon"}}],
            r"^optimizer.groups.0.optimizer \(Muon\): Muon only supports 2D parameters",
        ),
        (
            [{"params": "@biases", "optimizer": {"_target_": "gradmod.optim.Muon"}}],
            r"^optimizer.groups.0.optimizer \(Muon\): Muon takes matrices and convolution kernels .* shape \(32,\)",
        ),
        (
            [{"params": "l1.*", "optimizer": {"_target_": "torch.optim.LBFGS"}}],
            r"^optimizer.groups.0.optimizer._target_: LBFGS.step needs a closure .*allowed: an optimizer whose step",
        ),
        (
            [{"params": "l1.*", "optimizer": {"_target_": "gradmod.optim.Muon", "lr": "abc"}}],
            r"^optimizer.groups.0.optimizer.lr: 'abc' must be a finite number >= 0 \(a learning rate\)$",
        ),
        (
            [{"params": "l1.*", "optimizer": {"_target_": "gradmod.optim.Muon", "momentum": "high"}}],
            r"^optimizer.groups.0.optimizer.momentum: 'high' must be a number \(Muon's default: 0.95\)$",
        ),
        (
            [{"params": "l1.*", "optimizer": {"_target_": "torch.nn.Linear"}}],
            r"^optimizer.groups.0.optimizer._target_='torch.nn.Linear' is not a torch.optim.Optimizer; e.g. ",
        ),
        ({"params": "l1.*"}, r"^optimizer.groups: \{'params': 'l1.\*'\} must be a list of entries, e.g. \["),
    ],
)
def test_a_bad_entry_is_one_line(groups, line):
    with pytest.raises(ValueError, match=line) as e:
        gradmod.optimizer(MnistCNN(1, 10), {**ADAMW, "groups": groups})
    assert "\n" not in str(e.value)


def test_no_decay_on_an_optimizer_without_weight_decay_is_one_line():
    spec = {
        **ADAMW,
        "no_decay": ["*.bias"],
        "groups": [{"params": "l1.*", "optimizer": {"_target_": "torch.optim.Rprop"}}],
    }
    with pytest.raises(
        ValueError, match=r"^optimizer.no_decay: optimizer.groups.0.optimizer._target_ \(Rprop\) has no"
    ):
        gradmod.optimizer(MnistCNN(1, 10), spec)


def test_a_bad_group_from_the_command_line_is_one_line_and_exit_2(tmp_path):
    cfg = compose_config(*TINY_FAKE, "optimizer.groups=[{params: conv*}, {params: conv1.*}]")
    ending = runner.execute(lambda: validate(cfg), tmp_path / "run")
    assert ending.status == "failed" and ending.exit_code == 2
    line = endings.message(ending.error)
    assert "\n" not in line and line.startswith("optimizer.groups.1.params: conv1.weight is matched by")


@pytest.mark.parametrize("name", ["Lion", "AdaBelief"])
def test_a_pytorch_optimizer_class_is_an_entrys_optimizer_as_by_hand(name):
    """Its ``**kwargs`` become its defaults: its arguments are the ones it names, and any other."""
    cls = getattr(pytest.importorskip("pytorch_optimizer", reason="pytorch-optimizer is a test dependency"), name)
    target = f"pytorch_optimizer.{name}"
    torch.manual_seed(0)
    model, twin = MnistCNN(1, 10), MnistCNN(1, 10)
    twin.load_state_dict(model.state_dict())
    opt = gradmod.optimizer(
        model, {**ADAMW, "groups": [{"params": "l1.*", "optimizer": {"_target_": target, "lr": 1e-4}}]}
    )
    head = [twin.l1.weight, twin.l1.bias]
    pair = [
        torch.optim.AdamW([p for p in twin.parameters() if all(p is not q for q in head)], lr=1e-3, weight_decay=0.1),
        cls(head, lr=1e-4),
    ]
    for step in range(3):
        x = torch.randn(4, 1, 28, 28, generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        for o in pair:
            o.zero_grad()
        twin(x).square().mean().backward()
        for o in pair:
            o.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))
    apply_optimizer(opt, {"optimizer.lr": (1e-3, 5e-4)})  # a resume's new base lr: not the entry's optimizer's
    assert [g["lr"] for g in opt.param_groups] == [5e-4, 1e-4]
    base = gradmod.optimizer(model, {"_target_": target, "lr": 1e-4, "weight_decay": 0.1, "no_decay": ["*.bias"]})
    assert type(base) is cls and [g["weight_decay"] for g in base.param_groups] == [0.1, 0.0]


def test_a_mapping_for_groups_on_the_command_line_is_one_line(monkeypatch):
    override = "optimizer.groups={params: conv*}"
    monkeypatch.setattr(sys, "argv", ["train.py", override])
    with pytest.raises(Exception) as e:
        compose_config(override)
    assert describe(e.value) == f"{override}: optimizer.groups is a list; write optimizer.groups=[{{params: conv*}}]"


@pytest.mark.parametrize(
    ("overrides", "line"),
    [
        (
            ["optimizer.groups=[{params: 'l1.*', momentum: 0.9}]"],
            r"^optimizer.groups.0.momentum: Adam takes no argument 'momentum'; it takes lr, betas",
        ),
        (
            ["optimizer.groups=[{params: 'l1.*', optimizer: {_target_: torch.optim.Nope}}]"],
            r"^optimizer.groups.0.optimizer._target_='torch.optim.Nope' does not import \(.*\); e.g. torch.optim.SGD",
        ),
        (
            ["optimizer.groups=[{params: 'l1.*', optimizer: {_target_: torch.optim.LBFGS}}]"],
            r"^optimizer.groups.0.optimizer._target_: LBFGS.step needs a closure",
        ),
        (
            ["optimizer=muon", "optimizer.groups.0.optimizer.lr=abc"],
            r"^optimizer.groups.0.optimizer.lr: 'abc' must be a finite number >= 0 \(a learning rate\)$",
        ),
        (
            ["optimizer.groups=[{params: 5}]"],
            r"^optimizer.groups.0.params: 5 must be a glob or a non-empty list of globs$",
        ),
        (
            ["optimizer.groups=[{params: '@matrix'}]"],
            r"^optimizer.groups.0.params: '@matrix' is not a selector; allowed: ",
        ),
        (["optimizer.groups=[{params: 'l1.*', lr_scale: -1}]"], r"^optimizer.groups.0.lr_scale: -1 must be a finite"),
        (["optimizer.groups=[{params: 'l1.*', lr: -1}]"], r"^optimizer.groups.0.lr: -1 must be a finite number >= 0"),
        (
            ["optimizer.groups=[{params: 'l1.*', betas: [0.9, 1.5]}]"],
            r"^optimizer.groups.0 \(Adam\): Invalid beta parameter at index 1: 1.5$",
        ),
        (
            ["optimizer=muon", "optimizer.groups.0.optimizer.momentum=-1"],
            r"^optimizer.groups.0.optimizer \(Muon\): momentum should be >= 0 but is: -1",
        ),
    ],
)
def test_the_config_check_refuses_a_bad_entry_before_the_model(overrides, line):
    with pytest.raises(ValueError, match=line) as e:
        validate(compose_config(*TINY_FAKE, *overrides))
    assert "\n" not in str(e.value)


def test_the_config_check_leaves_what_a_glob_matches_to_the_model():
    cfg = validate(compose_config(*TINY_FAKE, "optimizer.groups=[{params: 'conv3.*'}]"))
    with pytest.raises(ValueError, match=r"^optimizer.groups.0.params: 'conv3.\*' matches no parameter"):
        gradmod.optimizer(MnistCNN(1, 10), {"_target_": cfg.optimizer._target_, "groups": cfg.optimizer.groups})
