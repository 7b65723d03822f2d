"""``orthogonalize`` + SGD against ``torch.optim.Muon``, and clip-then-orthogonalize against
``clip_grad_norm_`` then Muon.

Two runs of Muon whose scale factors differ in the last bit of one product (``lr *
ratio`` against ``lr`` times ``ratio * update``) drift apart after a few steps: one
bfloat16 rounding in the Newton-Schulz input flips, and the step moves by ``lr`` times a
bfloat16 unit. So the free-running comparisons use shapes whose factor for every
``adjust_lr`` is a power of two (25 x 100, 100 x 25, 25 x 25; the MNIST CNN's wide
classifier under ``original``), where the products are exact and the runs agree to the bit;
any shape is compared step by step, both runs starting every step from Muon's parameters.
"""

from __future__ import annotations

import io
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradmod.hooks import attach
from gradmod.hooks.fused.orthogonalize import Orthogonalize, lr_ratio
from gradmod.models import MnistCNN

LR = 0.02
ADJUST = ["original", "match_rms_adamw", "spectral_unclamped"]
MOMENTA = [(0.95, True), (0.9, False), (0.0, False)]


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny bfloat16 matrix products: a second thread only adds contention (10x on 2 cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def exact_mlp() -> nn.Module:
    """Every matrix's factor a power of two under every ``adjust_lr``."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(25, 100, bias=False),
        nn.Tanh(),
        nn.Linear(100, 25, bias=False),
        nn.Tanh(),
        nn.Linear(25, 25, bias=False),
    )


def odd_mlp() -> nn.Module:
    """A tall, a square and a wide matrix with factors that are not powers of two."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(20, 48, bias=False),
        nn.Tanh(),
        nn.Linear(48, 48, bias=False),
        nn.Tanh(),
        nn.Linear(48, 10, bias=False),
    )


def batches(n: int, features: int, classes: int, steps: int = 20) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(n, features, generator=g), torch.randint(0, classes, (n,), generator=g)) for _ in range(steps)]


def rule(params="*", **args) -> dict:
    return {"o": {"params": params, "transforms": [{"name": "orthogonalize", **args}]}}


def backward(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()


def run_pair(ours, ref, hooks, sgd, muon, data, forced=False, extra=()):
    """Both models through ``data``; ``forced``: every step starts ours from Muon's
    parameters. Returns the largest difference seen after any step. ``extra``: optimizers
    stepped in both runs alike (the layers Muon does not take)."""
    worst = 0.0
    for x, y in data:
        backward(ours, x, y)
        backward(ref, x, y)
        hooks.after_backward()
        for opt in (sgd, muon, *extra):
            opt.step()
        for p, q in zip(ours.parameters(), ref.parameters()):
            worst = max(worst, (p - q).abs().max().item())
        if forced:
            with torch.no_grad():
                for p, q in zip(ours.parameters(), ref.parameters()):
                    p.copy_(q)
    return worst


def moved(model: nn.Module, start: nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(model.parameters(), start.parameters()))


@pytest.mark.parametrize("adjust_lr", ADJUST)
@pytest.mark.parametrize("momentum,nesterov", MOMENTA)
def test_sgd_on_it_steps_as_torch_muon_for_20_steps(adjust_lr, momentum, nesterov):
    ours, ref = exact_mlp(), exact_mlp()
    hooks = attach(ours, rule(momentum=momentum, nesterov=nesterov, adjust_lr=adjust_lr))
    sgd = torch.optim.SGD(ours.parameters(), lr=LR)
    muon = torch.optim.Muon(
        ref.parameters(), lr=LR, weight_decay=0, momentum=momentum, nesterov=nesterov, adjust_lr_fn=adjust_lr
    )
    assert run_pair(ours, ref, hooks, sgd, muon, batches(16, 25, 25)) <= 1e-6
    assert all(torch.equal(p, q) for p, q in zip(ours.parameters(), ref.parameters()))  # here, to the bit
    assert moved(ours, exact_mlp()) > 0.05


@pytest.mark.parametrize("adjust_lr", ADJUST)
def test_each_step_equals_muons_on_any_shape(adjust_lr):
    ours, ref = odd_mlp(), odd_mlp()
    hooks = attach(ours, rule(adjust_lr=adjust_lr))
    sgd = torch.optim.SGD(ours.parameters(), lr=LR)
    muon = torch.optim.Muon(ref.parameters(), lr=LR, weight_decay=0, adjust_lr_fn=adjust_lr)
    assert run_pair(ours, ref, hooks, sgd, muon, batches(16, 20, 10), forced=True) <= 1e-6
    assert moved(ours, odd_mlp()) > 0.05
    assert {lr_ratio(adjust_lr, *p.shape) for p in ours.parameters()} - {1.0}  # the factors bite


def cnn_pair():
    torch.manual_seed(0)
    ours = MnistCNN()
    ref = MnistCNN()
    ref.load_state_dict(ours.state_dict())
    return ours, ref


@pytest.mark.parametrize("adjust_lr", ADJUST)
def test_the_mnist_cnns_classifier_as_muon_with_sgd_beside_it(adjust_lr):
    ours, ref = cnn_pair()
    hooks = attach(ours, rule("l1.weight", adjust_lr=adjust_lr))
    sgd = torch.optim.SGD(ours.parameters(), lr=LR)
    muon = torch.optim.Muon([ref.l1.weight], lr=LR, weight_decay=0, adjust_lr_fn=adjust_lr)
    rest = torch.optim.SGD([p for n, p in ref.named_parameters() if n != "l1.weight"], lr=LR)
    g = torch.Generator().manual_seed(2)
    data = [(torch.randn(8, 1, 28, 28, generator=g), torch.randint(0, 10, (8,), generator=g)) for _ in range(20)]
    # (10, 1568): a wide matrix, factor 1 under original, so its run is free; the others step by step
    forced = adjust_lr != "original"
    assert run_pair(ours, ref, hooks, sgd, muon, data, forced=forced, extra=(rest,)) <= 1e-6


class FlatConv(nn.Module):
    """A convolution whose kernel is stored as the (out, in * k * k) matrix Muon takes."""

    def __init__(self, conv: nn.Conv2d):
        super().__init__()
        self.shape = conv.weight.shape
        self.weight = nn.Parameter(conv.weight.detach().reshape(self.shape[0], -1).clone())

    def forward(self, x):
        return F.conv2d(x, self.weight.view(self.shape))


def test_a_conv_kernel_is_orthogonalized_as_out_by_the_rest():
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 8, 3, bias=False)  # (8, 27): wide
    tall = nn.Conv2d(1, 16, 2, bias=False)  # (16, 4): tall, transposed inside
    ours = nn.Sequential(conv, nn.Tanh(), nn.Conv2d(8, 1, 1, bias=False), nn.Flatten())
    ref = nn.Sequential(FlatConv(conv), nn.Tanh(), nn.Conv2d(8, 1, 1, bias=False), nn.Flatten())
    ref[2].load_state_dict(ours[2].state_dict())
    hooks = attach(ours, rule("0.weight"))
    sgd = torch.optim.SGD(ours.parameters(), lr=LR)
    muon = torch.optim.Muon([ref[0].weight], lr=LR, weight_decay=0)
    rest = torch.optim.SGD(ref[2].parameters(), lr=LR)
    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(4, 3, 6, 6, generator=g), torch.randint(0, 16, (4,), generator=g)) for _ in range(10)]
    for x, y in data:
        for model in (ours, ref):
            model.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
        hooks.after_backward()
        for opt in (sgd, muon, rest):
            opt.step()
        torch.testing.assert_close(ours[0].weight.reshape(8, -1), ref[0].weight, rtol=0, atol=1e-6)
        with torch.no_grad():
            ours[0].weight.copy_(ref[0].weight.view(ours[0].weight.shape))
            ours[2].weight.copy_(ref[2].weight)
    # the tall kernel too: one step against torch's own update on the (16, 4) matrix
    fn = Orthogonalize(momentum=0.0)
    grad = torch.randn_like(tall.weight)
    flat = FlatConv(tall)
    flat.weight.grad = grad.reshape(16, -1).clone()
    step = torch.optim.Muon([flat.weight], lr=1.0, weight_decay=0, momentum=0.0)
    before = flat.weight.detach().clone()
    step.step()
    got = grad.clone()
    fn.apply_([tall.weight], [got])
    torch.testing.assert_close(got.reshape(16, -1), before - flat.weight.detach(), rtol=0, atol=1e-6)


def test_clip_then_orthogonalize_is_clip_grad_norm_then_muon():
    max_norm = 0.05
    ours, ref = exact_mlp(), exact_mlp()
    rules = {
        "o": {
            "params": "*",
            "transforms": [
                {"name": "global_norm_clip", "max_norm": max_norm},
                {"name": "orthogonalize", "momentum": 0.9, "adjust_lr": "match_rms_adamw"},
            ],
        }
    }
    hooks = attach(ours, rules)
    sgd = torch.optim.SGD(ours.parameters(), lr=LR)
    muon = torch.optim.Muon(ref.parameters(), lr=LR, weight_decay=0, momentum=0.9, adjust_lr_fn="match_rms_adamw")
    for x, y in batches(16, 25, 25, steps=10):
        backward(ours, x, y)
        backward(ref, x, y)
        hooks.after_backward()
        assert torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm) > 2 * max_norm  # the clip bites
        sgd.step()
        muon.step()
    assert all(torch.equal(p, q) for p, q in zip(ours.parameters(), ref.parameters()))
    assert hooks.read_stats()["o/global_norm_clip"]["calls"] == 10


def test_the_momentum_resumes_to_the_bit_from_state_dict():
    data = batches(16, 20, 10, steps=12)

    def start():
        model = odd_mlp()
        hooks = attach(model, rule(momentum=0.9, nesterov=True))
        return model, hooks, torch.optim.SGD(model.parameters(), lr=LR)

    def train(model, hooks, opt, part):
        for x, y in part:
            backward(model, x, y)
            hooks.after_backward()
            opt.step()

    whole = start()
    train(*whole, data)
    first = start()
    train(*first, data[:6])
    saved = io.BytesIO()
    torch.save({"model": first[0].state_dict(), "opt": first[2].state_dict(), "hooks": first[1].state_dict()}, saved)
    train(*first, data[6:8])  # the first run goes on: the saved state must not follow it
    saved.seek(0)
    state = torch.load(saved, weights_only=True)
    assert sorted(state["hooks"]["group"]["o/orthogonalize"]["momentum"]) == ["0.weight", "2.weight", "4.weight"]
    model, hooks, opt = start()
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    hooks.load_state_dict(state["hooks"])
    train(model, hooks, opt, data[6:])
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), whole[0].parameters()))
    fresh = start()  # without the momentum the run differs: the state is what made it equal
    fresh[0].load_state_dict(state["model"])
    train(*fresh, data[6:])
    assert not all(torch.equal(p, q) for p, q in zip(fresh[0].parameters(), whole[0].parameters()))


def test_momentum_of_another_shape_is_one_line():
    model = odd_mlp()
    hooks = attach(model, rule())
    bad = {"momentum": {"2.weight": torch.zeros(3, 3)}}
    with pytest.raises(ValueError, match=r"^orthogonalize: the momentum of '2.weight' has shape \(3, 3\)") as e:
        hooks.load_state_dict({"group": {"o/orthogonalize": bad}})
    assert "\n" not in str(e.value)


def test_a_vector_is_refused_at_attach_in_one_line():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    with pytest.raises(ValueError) as e:
        attach(model, rule())
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith("hooks.o: orthogonalize acts on matrices, and '0.bias' has shape (3,)")
    assert "exclude" in message and "2 or more dims" in message
    hooks = attach(model, rule(params="*.weight"))  # the matrices alone attach
    assert [name for name, _ in hooks.chains] == ["0.weight", "1.weight"]


@pytest.mark.parametrize(
    "args,expected",
    [
        ({"steps": 0}, "steps=0 must be an int >= 1"),
        ({"steps": 2.5}, "steps=2.5 must be an int >= 1"),
        ({"coefficients": [1.0, 2.0]}, r"coefficients=\[1.0, 2.0\] must be 3 numbers"),
        ({"coefficients": [1.0, "b", 2.0]}, "coefficients='b' must be a number"),
        ({"eps": 0}, "eps=0 must be > 0"),
        ({"momentum": 1.0}, r"momentum=1.0 must be in \[0, 1\)"),
        ({"nesterov": "yes"}, "nesterov='yes' must be true or false"),
        (
            {"adjust_lr": "moonshot"},
            "adjust_lr='moonshot'; allowed: original, match_rms_adamw, spectral_unclamped, none",
        ),
    ],
)
def test_bad_arguments_are_one_line(args, expected):
    with pytest.raises(ValueError, match=r"^hooks.o.transforms: transform 'orthogonalize': " + expected) as e:
        attach(exact_mlp(), rule(**args))
    assert "\n" not in str(e.value)


def test_none_leaves_the_orthogonalized_matrix_unscaled():
    g = torch.randn(100, 25)
    raw, scaled = g.clone(), g.clone()
    Orthogonalize(momentum=0.0, adjust_lr="none").apply_([g], [raw])
    Orthogonalize(momentum=0.0, adjust_lr="original").apply_([g], [scaled])
    assert torch.equal(scaled, raw * 2.0)
    singular = torch.linalg.svdvals(raw)  # near 1, as the quintic leaves them (not exactly 1)
    assert 0.5 < singular.min() and singular.max() < 1.5


def test_a_non_finite_gradient_leaves_the_momentum_as_it_was():
    ours, ref = exact_mlp(), exact_mlp()
    hooks = attach(ours, rule(momentum=0.9))
    sgd = torch.optim.SGD(ours.parameters(), lr=LR)
    muon = torch.optim.Muon(ref.parameters(), lr=LR, weight_decay=0, momentum=0.9)
    data = batches(16, 25, 25, steps=4)
    state = hooks.state_dict
    for i, (x, y) in enumerate(data):
        backward(ours, x, y)
        if i == 2:  # an overflowed step, which the loop skips (GradScaler, nonfinite=skip)
            before = state()["group"]["o/orthogonalize"]["momentum"]
            ours[0].weight.grad[0, 0] = math.inf
            hooks.after_backward()
            after = state()["group"]["o/orthogonalize"]["momentum"]
            assert all(torch.equal(before[n], after[n]) for n in before)
            assert not torch.isfinite(ours[0].weight.grad).all()
            continue
        backward(ref, x, y)
        hooks.after_backward()
        sgd.step()
        muon.step()
    assert all(torch.equal(p, q) for p, q in zip(ours.parameters(), ref.parameters()))
