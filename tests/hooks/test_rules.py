import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradmod
from gradmod.models import MnistCNN


class Small(nn.Module):
    """The first article's myNet: conv -> relu -> flatten -> fc1, on one 3x8x8 image."""

    def __init__(self, act_hook=None):
        super().__init__()
        self.conv = nn.Conv2d(3, 10, 2, stride=2)
        self.relu = nn.ReLU()
        self.fc1 = nn.Linear(160, 5)
        self.act_hook = act_hook

    def forward(self, x):
        x = self.relu(self.conv(x))
        if self.act_hook is not None:  # the article's hand-written activation hook
            x.register_hook(self.act_hook)
        return self.fc1(x.flatten(1))


def grads(model, x, y):
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.fixture
def batch():
    torch.manual_seed(0)
    return torch.randn(4, 3, 8, 8) * 5, torch.tensor([0, 1, 2, 3])


def test_clip_equals_clip_grad_value(batch):
    torch.manual_seed(1)
    hooked, plain = Small(), Small()
    plain.load_state_dict(hooked.state_dict())
    with gradmod.attach(
        hooked, {"clip": {"params": "*", "transforms": [{"name": "clamp", "min": -0.01, "max": 0.01}]}}
    ):
        got = grads(hooked, *batch)
    want = grads(plain, *batch)
    torch.nn.utils.clip_grad_value_(plain.parameters(), 0.01)
    assert any((w.abs() > 0.01).any() for w in want.values()), "the test needs gradients to clip"
    for n, p in plain.named_parameters():
        assert torch.equal(got[n], p.grad), n


def test_zero_keeps_biases_fixed_under_adam(batch):
    model = MnistCNN()
    before = copy.deepcopy(model.state_dict())
    opt = torch.optim.Adam(model.parameters())
    x, y = torch.rand(8, 1, 28, 28), torch.arange(8)
    with gradmod.attach(model, {"zero": {"params": "*.bias", "transforms": ["zero"]}}) as hooks:
        for _ in range(3):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    assert [n for n, _ in hooks.chains] == ["conv1.bias", "conv2.bias", "l1.bias"]
    for name, value in model.state_dict().items():
        changed = not torch.equal(value, before[name])
        assert changed == name.endswith("weight"), name


def test_min_zero_leaves_no_negative_conv_gradient():
    model = MnistCNN()
    x, y = torch.rand(8, 1, 28, 28), torch.arange(8)
    plain = grads(model, x, y)
    assert (plain["conv1.weight"] < 0).any()
    with gradmod.attach(model, {"min_zero": {"params": "*conv*.weight", "transforms": ["min_zero"]}}):
        got = grads(model, x, y)
    for n in ("conv1.weight", "conv2.weight"):
        assert (got[n] >= 0).all() and torch.equal(got[n], plain[n].clamp(min=0))
    assert torch.equal(got["l1.weight"], plain["l1.weight"])


def test_modules_rule_equals_hand_written_activation_hook(batch):
    torch.manual_seed(2)
    hand = Small(act_hook=lambda g: g.clamp(min=0))
    ruled = Small()
    ruled.load_state_dict(hand.state_dict())
    want = grads(hand, *batch)
    with gradmod.attach(ruled, {"pos": {"modules": "relu", "transforms": ["min_zero"]}}) as hooks:
        got = grads(ruled, *batch)
        assert hooks.chains == [("relu:output", ["min_zero"])]
    plain = grads(ruled, *batch)  # hooks removed
    assert not torch.equal(want["conv.weight"], plain["conv.weight"]), "the rule must change something"
    for n in want:
        assert torch.equal(got[n], want[n]), n


def test_remove_restores_plain_gradients_and_attach_twice_does_not_double(batch):
    torch.manual_seed(3)
    model = Small()
    plain = grads(model, *batch)
    rules = {"double": {"params": "*", "transforms": [{"name": "scale", "factor": 2.0}]}}
    first = gradmod.attach(model, rules)
    second = gradmod.attach(model, rules)  # replaces the first: the scale applies once
    assert len(first) == 0 and len(second) == 4
    for n, g in grads(model, *batch).items():
        assert torch.allclose(g, 2 * plain[n]), n
    second.remove()
    for n, g in grads(model, *batch).items():
        assert torch.equal(g, plain[n]), n
    assert all(not p._backward_hooks for p in model.parameters())


def test_rules_chain_in_config_order(batch):
    model = Small()
    plain = grads(model, *batch)
    rules = {
        "clip": {"params": "fc1.weight", "transforms": [{"name": "clamp", "min": -0.01, "max": 0.01}]},
        "triple": {"params": ["fc1.*"], "transforms": [{"name": "scale", "factor": 3.0}]},
    }
    with gradmod.attach(model, rules) as hooks:
        got = grads(model, *batch)
        assert dict(hooks.chains)["fc1.weight"] == ["clamp", "scale"]
    assert torch.allclose(got["fc1.weight"], 3 * plain["fc1.weight"].clamp(-0.01, 0.01))
    assert torch.allclose(got["fc1.bias"], 3 * plain["fc1.bias"])


@pytest.mark.parametrize(
    "spec",
    [
        {"name": "clamp", "min": -0.01, "max": 0.01},
        "zero",
        "min_zero",
        {"name": "scale", "factor": -2.0},
        "sign",
        {"name": "norm_clip", "max_norm": 0.1},
        "centralize",
    ],
)
def test_fused_stage_equals_hook_stage(spec, batch):
    torch.manual_seed(4)
    model = Small()
    rules = {
        "a": {"params": "*", "exclude": "conv.bias", "transforms": [spec]},
        "b": {"params": "fc1.*", "transforms": [{"name": "clamp", "max": 0.05}]},
    }
    with gradmod.attach(model, rules, stage="hook"):
        want = grads(model, *batch)
    with gradmod.attach(model, rules, stage="fused") as hooks:
        got = grads(model, *batch)
        hooks.after_backward()
        got = {n: p.grad for n, p in model.named_parameters()}
    for n in want:
        assert torch.allclose(got[n], want[n], atol=1e-7), n


def test_log_reads_all_statistics_in_one_go(batch):
    model = Small()
    with gradmod.attach(model, {"log": {"params": "*.bias", "transforms": ["log"]}}) as hooks:
        g = grads(model, *batch)
        stats = hooks.read_stats()
    assert set(stats) == {"conv.bias", "fc1.bias"}
    assert stats["fc1.bias"]["norm"] == pytest.approx(g["fc1.bias"].norm().item(), rel=1e-6)
    assert stats["fc1.bias"]["min"] == pytest.approx(g["fc1.bias"].min().item())
    assert stats["fc1.bias"]["any_negative"] == bool((g["fc1.bias"] < 0).any())


def test_describe_and_format_plan():
    model = Small()
    hooks = gradmod.attach(
        model, {"clip": {"params": "fc1.*", "stage": "fused", "transforms": [{"name": "clamp", "min": -1, "max": 1}]}}
    )
    assert hooks.describe()[0] == {
        "tensor": "fc1.weight",
        "rule": "clip",
        "stage": "fused",
        "transforms": ["clamp(min=-1, max=1)"],
    }
    assert "fc1.bias" in hooks.format_plan()
    hooks.remove()


def test_plan_lists_hook_stage_before_fused_as_they_run(batch):
    """A fused rule first in the config still runs after a hook rule on the same tensor
    (hooks run during backward, the fused stage after it): the plan says so."""
    model = Small()
    plain = grads(model, *batch)
    rules = {
        "clip": {
            "params": "fc1.weight",
            "stage": "fused",
            "transforms": [{"name": "clamp", "min": -0.01, "max": 0.01}],
        },
        "triple": {"params": "fc1.*", "transforms": [{"name": "scale", "factor": 3.0}]},
    }
    with gradmod.attach(model, rules) as hooks:
        grads(model, *batch)
        hooks.after_backward()
        assert dict(hooks.chains)["fc1.weight"] == ["scale", "clamp"]
        assert [(d["tensor"], d["rule"]) for d in hooks.describe()] == [
            ("fc1.weight", "triple"),
            ("fc1.bias", "triple"),
            ("fc1.weight", "clip"),
        ]
        lines = hooks.format_plan().splitlines()[1:]
        assert "triple: scale" in lines[0] and "clip: clamp" in lines[2]
        got = model.fc1.weight.grad
    assert torch.equal(got, (3 * plain["fc1.weight"]).clamp(-0.01, 0.01))  # the order the plan lists
    assert not torch.equal(got, 3 * plain["fc1.weight"].clamp(-0.01, 0.01))  # not config order


@pytest.mark.parametrize(
    "rules, message",
    [
        (
            {"r": {"params": "fc.weight", "transforms": ["zero"]}},
            "hooks.r.params: 'fc.weight' matches no parameter (see model.named_parameters()); close names: fc1.weight",
        ),
        ({"r": {"modules": "rleu", "transforms": ["zero"]}}, "hooks.r.modules: 'rleu' matches no module"),
        (
            {"r": {"params": "*", "exclude": "nothing*", "transforms": ["zero"]}},
            "hooks.r.exclude: 'nothing*' matches no",
        ),
        ({"r": {"params": "fc1.*", "exclude": "fc1.*", "transforms": ["zero"]}}, "exclude removes every"),
        ({"r": {"params": "*", "transforms": ["zeroo"]}}, "hooks.r.transforms: unknown transform 'zeroo'; allowed:"),
        (
            {"r": {"params": "*", "transforms": [{"name": "clamp", "min": 1, "max": 0}]}},
            "hooks.r.transforms: transform 'clamp': min=1 is greater than max=0",
        ),
        ({"r": {"params": "*", "transforms": []}}, "hooks.r.transforms: give at least one of"),
        (
            {"r": {"params": "*", "modules": "conv", "transforms": ["zero"]}},
            "give exactly one of 'params' or 'modules'",
        ),
        ({"r": {"params": "*", "transform": ["zero"]}}, "unknown key(s) transform; allowed: params, modules"),
        ({"r": {"params": "*", "stage": "late", "transforms": ["zero"]}}, "hooks.r.stage: 'late' is not a stage"),
        ({"r": {"modules": "relu", "stage": "fused", "transforms": ["zero"]}}, "'fused' needs params"),
        ({"r": {"params": [], "transforms": ["zero"]}}, "must be a glob or a non-empty list of globs"),
        ({"r": "zero"}, "hooks.r: a rule must be a mapping"),
    ],
)
def test_bad_rules_are_clear_value_errors(rules, message):
    model = Small()
    with pytest.raises(ValueError) as e:
        gradmod.attach(model, rules)
    assert message in str(e.value)
    assert all(not p._backward_hooks for p in model.parameters()), "nothing attached on error"


def test_hookset_counts_the_tensors_it_transforms_whatever_the_stage(batch):
    """A set with only fused or group rules registers no hook handle, yet it is true, so
    ``if hooks: hooks.after_backward()`` runs its stage (here: == clip_grad_norm_)."""
    model, plain = Small(), Small()
    plain.load_state_dict(model.state_dict())
    rules = {
        "norm": {"params": "fc1.*", "transforms": [{"name": "global_norm_clip", "max_norm": 0.01}]},
        "relu": {"modules": "relu", "transforms": [{"name": "scale", "factor": 2.0}]},
    }
    hooks = gradmod.attach(model, {"norm": rules["norm"]})
    assert len(hooks) == 2 and hooks
    grads(model, *batch)
    if hooks:
        hooks.after_backward()
    grads(plain, *batch)
    torch.nn.utils.clip_grad_norm_([plain.fc1.weight, plain.fc1.bias], 0.01)
    assert torch.equal(model.fc1.weight.grad, plain.fc1.weight.grad)
    hooks.remove()
    assert len(hooks) == 0 and not hooks
    with gradmod.attach(model, rules) as both:  # a module output counts once, as ``relu:output``
        assert len(both) == 3
