"""The per_sample stage against independent computations: torch.func's vmap(grad), Opacus,
the noise's statistics; its refusals; and that it leaves the model as it was."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

from gradmod.hooks import attach
from gradmod.hooks.per_sample.forms import layers
from gradmod.hooks.stage import Loop


def dp_rule(max_norm=1.0, noise=0.0, params="*", extra=()):
    clip = {"name": "per_sample_clip", "max_norm": max_norm, "noise_multiplier": noise}
    return {"dp": {"params": params, "transforms": [clip, *extra]}}


class Scale(nn.Module):
    """A custom parameterised layer (no closed form): the torch.func path."""

    def __init__(self, n):
        super().__init__()
        self.w = nn.Parameter(torch.randn(n))

    def forward(self, x):
        w = self.w.view(1, -1, *[1] * (x.dim() - 2))
        return x * w + torch.tanh(x) * w**2


class GroupNormCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.gn = nn.GroupNorm(2, 8)
        self.scale = Scale(8)
        self.c2 = nn.Conv2d(8, 8, 3, stride=2, groups=2, dilation=2, padding=2, padding_mode="reflect")
        self.ln = nn.LayerNorm(8)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        x = F.relu(self.scale(self.gn(self.c1(x))))
        return self.fc(self.ln(self.c2(x).mean((2, 3))))


class Convs(nn.Module):
    """Conv1d and Conv3d; per-example weights where Gram matrices do not pay."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv1d(2, 4, 3, padding="same", bias=False)
        self.c3 = nn.Conv3d(1, 3, 2, stride=(1, 2, 1))
        self.fc = nn.Linear(4 + 3, 3)

    def forward(self, x):
        a, b = x
        return self.fc(torch.cat([self.c1(a).mean(2), self.c3(b).mean((2, 3, 4))], 1))


class Sequence(nn.Module):
    """Embedding (with a padding row) tied to the output layer, a Linear on [B, T, d]
    (Gram path and per-example path) and a layer called twice."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 6, padding_idx=0)
        self.wide = nn.Linear(6, 40)  # T (5) * (6 + 40) < 6 * 40: Gram matrices
        self.narrow = nn.Linear(40, 4)  # per-example weights (T (40 + 4) > 40 * 4)
        self.twice = nn.Linear(4, 4)
        self.up = nn.Linear(4, 6)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        h = self.narrow(torch.tanh(self.wide(self.emb(idx))))
        return self.head(self.up(self.twice(torch.tanh(self.twice(h)))))


class TwoWay(nn.Module):
    """Two inputs, two outputs, one of them unused by the loss: the torch.func path."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4))
        self.v = nn.Parameter(torch.randn(3, 4))

    def forward(self, x, z, scale=2.0):
        return torch.sin(x * self.w) * scale, z @ self.v, x.sum(1)


class CustomIO(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(7, 3, scale_grad_by_freq=True)  # batch-dependent: the torch.func path
        self.two = TwoWay()
        self.fc = nn.Linear(4, 3)

    def forward(self, idx):
        z = self.emb(idx).mean(1)
        a, b, _ = self.two(z.repeat(1, 2)[:, :4], z, scale=3.0)
        return self.fc(a + b)


def seq_loss(out, y):
    return F.cross_entropy(out.flatten(0, 1), y.flatten(), reduction="none").view(len(y), -1).sum(1)


def class_loss(out, y):
    return F.cross_entropy(out, y, reduction="none")


def reference(model, x, y, loss_fn, max_norm, divisor=None):
    """Mean of the clipped per-example gradients: vmap(grad) of one example's loss."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def one(p, xi, yi):
        xi = tuple(t.unsqueeze(0) for t in xi) if isinstance(xi, tuple) else xi.unsqueeze(0)
        out = functional_call(model, p, (xi,))
        return loss_fn(out, yi.unsqueeze(0)).sum()

    g = vmap(grad(one), in_dims=(None, 0, 0))(params, x, y)
    norms = torch.sqrt(sum(t.flatten(1).square().sum(1) for t in g.values()))
    coef = (max_norm / (norms + 1e-6)).clamp(max=1.0)
    n = divisor or len(y)
    return {k: torch.tensordot(coef, t, 1) / n for k, t in g.items()}, norms, g


CASES = {
    "groupnorm_cnn": (GroupNormCNN, lambda: torch.randn(6, 3, 8, 8), lambda: torch.randint(0, 4, (6,)), class_loss),
    "convs": (
        Convs,
        lambda: (torch.randn(6, 2, 9), torch.randn(6, 1, 4, 5, 3)),
        lambda: torch.randint(0, 3, (6,)),
        class_loss,
    ),
    "custom_io": (CustomIO, lambda: torch.randint(0, 7, (6, 4)), lambda: torch.randint(0, 3, (6,)), class_loss),
    "sequence": (Sequence, lambda: torch.randint(0, 11, (6, 5)), lambda: torch.randint(0, 11, (6, 5)), seq_loss),
}


def make(case, seed=0):
    torch.manual_seed(seed)
    cls, xs, ys, loss_fn = CASES[case]
    return cls(), xs(), ys(), loss_fn


def assert_grads(model, expected, atol=1e-6):
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, expected[name], atol=atol, rtol=1e-4, msg=name)


@pytest.mark.parametrize("keep", [True, False], ids=["materialise", "ghost_only"])
@pytest.mark.parametrize("case", list(CASES))
def test_clipped_mean_equals_vmap_grad_reference(case, keep, monkeypatch):
    if not keep:  # no [B, *param] kept: every closed form's norms and weighted sums
        monkeypatch.setattr(layers, "MATERIALISE_MAX", 0)
    model, x, y, loss_fn = make(case)
    _, norms, _ = reference(model, x, y, loss_fn, 1.0)
    max_norm = float(norms.median())  # about half the examples are clipped
    expected, _, _ = reference(model, x, y, loss_fn, max_norm)
    hooks = attach(model, dp_rule(max_norm))
    loss_fn(model(x), y).mean().backward()
    hooks.after_backward()
    assert_grads(model, expected)


def test_loss_reduction_sum_and_accumulation_equal_one_batch():
    model, x, y, loss_fn = make("groupnorm_cnn")
    expected, _, _ = reference(model, x, y, loss_fn, 1.0)
    hooks = attach(model, dp_rule(1.0), loss_reduction="sum")
    for part in (slice(0, 2), slice(2, 6)):  # micro-batches of different sizes, one step
        loss_fn(model(x[part]), y[part]).sum().backward()
        assert model.fc.weight.grad is None  # the plain batch gradient is not kept
    hooks.after_backward()
    assert_grads(model, expected)


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
def test_opacus_equal_on_its_mnist_example_net():
    opacus = pytest.importorskip("opacus", reason="opacus is the reference (pip install opacus==1.6.0)")

    from benchmarks.sections.per_sample import SampleConvNet  # opacus/examples/mnist.py, as the benchmark times it

    torch.manual_seed(0)
    ours = SampleConvNet()
    theirs = copy.deepcopy(ours)
    x, y = torch.randn(16, 1, 28, 28), torch.randint(0, 10, (16,))
    gsm = opacus.GradSampleModule(theirs)
    opt = opacus.optimizers.DPOptimizer(
        torch.optim.SGD(gsm.parameters(), lr=0.1), noise_multiplier=0.0, max_grad_norm=0.05, expected_batch_size=16
    )
    F.cross_entropy(gsm(x), y).backward()
    opt.pre_step()
    hooks = attach(ours, dp_rule(0.05))
    F.cross_entropy(ours(x), y).backward()
    hooks.after_backward()
    for (name, p), q in zip(ours.named_parameters(), gsm.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-7, rtol=1e-5, msg=name)


def test_noise_std_is_sigma_times_max_norm_over_batch_once_per_step():
    torch.manual_seed(0)
    model = nn.Linear(100, 100)
    x, y = torch.randn(8, 100), torch.randn(8, 100)
    hooks = attach(model, dp_rule(0.5, noise=2.0))
    hooks.stage("per_sample").generator = torch.Generator().manual_seed(1)
    for part in (slice(0, 3), slice(3, 8)):  # accumulation: the noise is drawn once, in after_backward
        F.mse_loss(model(x[part]), y[part]).backward()
    hooks.after_backward()
    noisy = torch.cat([p.grad.flatten() for p in model.parameters()])
    hooks.remove()
    model.zero_grad()
    plain = attach(model, dp_rule(0.5))
    for part in (slice(0, 3), slice(3, 8)):
        F.mse_loss(model(x[part]), y[part]).backward()
    plain.after_backward()
    noise = noisy - torch.cat([p.grad.flatten() for p in model.parameters()])
    want = 2.0 * 0.5 / 8
    assert noise.numel() == 10100
    assert abs(noise.std().item() / want - 1) < 0.03  # 10,100 draws: std of the estimate ~0.7%
    assert abs(noise.mean().item()) < 4 * want / 100


def test_expected_batch_size_is_the_divisor():
    model, x, y, loss_fn = make("groupnorm_cnn")
    expected, _, _ = reference(model, x, y, loss_fn, 1.0, divisor=10)
    hooks = attach(model, dp_rule(1.0))
    hooks.set_up(Loop(poisson=True, step_examples=10))  # Poisson sampling: the expected, not the drawn, size
    loss_fn(model(x), y).mean().backward()
    hooks.after_backward()
    assert_grads(model, expected)


def test_parameters_outside_the_rule_keep_their_plain_gradient_and_fused_runs_after():
    model, x, y, loss_fn = make("groupnorm_cnn")
    plain = copy.deepcopy(model)
    loss_fn(plain(x), y).mean().backward()
    head = {k for k, _ in model.named_parameters() if k.startswith("fc.")}
    rules = {
        **dp_rule(0.1, params="fc.*"),
        "double": {"params": "fc.*", "stage": "fused", "transforms": [{"name": "scale", "factor": 2.0}]},
    }
    hooks = attach(model, rules)
    loss_fn(model(x), y).mean().backward()
    hooks.after_backward()
    _, _, per_example = reference(model, x, y, loss_fn, 0.1)
    norms = torch.sqrt(sum(per_example[k].flatten(1).square().sum(1) for k in head))
    coef = (0.1 / (norms + 1e-6)).clamp(max=1.0)
    for name, p in model.named_parameters():
        want = (
            2 * torch.tensordot(coef, per_example[name], 1) / 6
            if name in head
            else dict(plain.named_parameters())[name].grad
        )
        torch.testing.assert_close(p.grad, want, atol=1e-6, rtol=1e-4, msg=name)


def test_log_statistics_equal_the_per_example_reference():
    model, x, y, loss_fn = make("groupnorm_cnn")
    _, norms, g = reference(model, x, y, loss_fn, 1.0)
    max_norm = float(norms.sort().values[2:4].mean())  # between two norms: no tie to round either way
    hooks = attach(model, dp_rule(max_norm, extra=["log"]))
    loss_fn(model(x), y).mean().backward()
    hooks.after_backward()
    stats = hooks.read_stats()
    n = len(y)
    mean_sq = sum(t.mean(0).square().sum() for t in g.values())
    sq = norms.square().mean()
    trace, signal = (sq - mean_sq) * n / (n - 1), (n * mean_sq - sq) / (n - 1)
    log = stats["dp/log"]
    assert log["p50"] == pytest.approx(norms.quantile(0.5).item(), rel=1e-5)
    assert log["p90"] == pytest.approx(norms.quantile(0.9).item(), rel=1e-5)
    assert log["max"] == pytest.approx(norms.max().item(), rel=1e-5)
    assert log["b_simple"] == pytest.approx((trace / signal).item(), rel=1e-3)
    clip = stats["dp/per_sample_clip"]
    assert clip["frac_clipped"] == pytest.approx((norms > max_norm).float().mean().item())
    assert clip["examples"] == n


def test_log_only_rule_leaves_the_gradient_alone():
    model, x, y, loss_fn = make("sequence")
    plain = copy.deepcopy(model)
    loss_fn(plain(x), y).mean().backward()
    _, norms, _ = reference(model, x, y, loss_fn, 1.0)
    hooks = attach(model, {"watch": {"params": "*", "stage": "per_sample", "transforms": ["log"]}})
    loss_fn(model(x), y).mean().backward()
    hooks.after_backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    assert hooks.read_stats()["watch/log"]["max"] == pytest.approx(norms.max().item(), rel=1e-5)


@pytest.mark.parametrize(
    "rules, match",
    [
        (
            {**dp_rule(), "c": {"params": "fc.*", "transforms": [{"name": "clamp", "max": 1}]}},
            "hook-stage rule on 'fc.weight'",
        ),
        (
            {
                "a": dp_rule(noise=1.0, params="c*")["dp"],
                "b": dp_rule(noise=1.0, params=["gn.*", "scale.*", "ln.*", "fc.*"])["dp"],
            },
            "both add noise",
        ),
        (dp_rule(noise=1.0, params="fc.*"), "not covered: c1.weight"),
        (
            {"dp": {"params": "*", "transforms": [{"name": "per_sample_clip", "max_norm": 1.0}, "clamp"]}},
            "'clamp' cannot run at stage 'per_sample'",
        ),
        ({"dp": {"modules": "fc", "transforms": [{"name": "per_sample_clip", "max_norm": 1.0}]}}, "needs params"),
        (
            {"dp": {"params": "*", "stage": "fused", "transforms": [{"name": "per_sample_clip", "max_norm": 1.0}]}},
            "stage 'per_sample' only",
        ),
        (dp_rule(max_norm=0), "max_norm=0 must be > 0"),
        (
            {"a": dp_rule(params="fc.*")["dp"], "b": dp_rule(params="fc.bias")["dp"]},
            "'fc.bias' is in two per_sample rules",
        ),
    ],
)
def test_refusals_are_one_line(rules, match):
    model, *_ = make("groupnorm_cnn")
    with pytest.raises(ValueError, match=match) as err:
        attach(model, rules)
    assert "\n" not in str(err.value)
    assert not model._forward_hooks and not any(m._forward_hooks for m in model.modules())


def test_noise_with_frozen_rest_trains_the_head_privately():
    model, x, y, loss_fn = make("groupnorm_cnn")
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith("fc."))
    hooks = attach(model, dp_rule(1.0, noise=1.0, params="fc.*"))
    loss_fn(model(x), y).mean().backward()
    hooks.after_backward()
    assert model.fc.weight.grad is not None and model.c1.weight.grad is None


def test_batchnorm_in_training_mode_is_refused_and_default_stage_per_sample_too():
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.LazyLinear(2))
    with pytest.raises(ValueError, match=r"BatchNorm in training mode .*\(1\); use GroupNorm"):
        attach(model, dp_rule())
    with pytest.raises(ValueError, match="per_sample is set per rule"):
        attach(model, {"c": {"params": "*", "transforms": ["zero"]}}, stage="per_sample")
    model.eval()  # frozen statistics do not mix the examples
    attach(model, dp_rule(), loss_reduction="sum").remove()


def test_remove_leaves_the_model_as_it_was_and_nothing_per_example_stays():
    model, x, y, loss_fn = make("sequence")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    names = [n for n, _ in model.named_parameters()]
    hooks = attach(model, dp_rule(0.5, extra=["log"]))
    assert [n for n, _ in model.named_parameters()] == names
    loss_fn(model(x), y).mean().backward()
    assert hooks.stage("per_sample")._calls == []  # the backward's inputs and output gradients are gone
    hooks.after_backward()
    assert hooks.stage("per_sample")._sums == {}
    with torch.no_grad():
        model(x)  # evaluation keeps nothing
    assert hooks.stage("per_sample")._calls == []
    hooks.remove()
    assert all(not m._forward_hooks for m in model.modules())
    model.zero_grad()
    loss_fn(model(x), y).mean().backward()
    plain = copy.deepcopy(model)
    plain.zero_grad()
    loss_fn(plain(x), y).mean().backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_resnet18_with_groupnorm_and_inplace_relu():
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=5, norm_layer=lambda c: nn.GroupNorm(min(32, c), c))
    x, y = torch.randn(3, 3, 32, 32), torch.randint(0, 5, (3,))
    expected, _, _ = reference(model, x, y, class_loss, 1.0)
    hooks = attach(model, dp_rule(1.0))
    class_loss(model(x), y).mean().backward()
    hooks.after_backward()
    assert_grads(model, expected, atol=1e-5)


def test_per_sample_is_no_default_stage_for_the_trainer():
    from gradmod.run.config import TrainerConfig

    with pytest.raises(
        ValueError,
        match="trainer.hook_stage=per_sample is not allowed: per_sample is a rule's own stage .*; allowed: hook, fused",
    ):
        TrainerConfig(hook_stage="per_sample")
