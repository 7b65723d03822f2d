"""experiment=dann's pieces: the shifted-domain digits, labels -100 left out of the loss and
the accuracy, and the reversal point of the model, against hand computations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from helpers import compose_config

from gradmod.data import load_dann_digits, load_mnist_sample
from gradmod.hooks import attach
from gradmod.models import DANNNet
from gradmod.training.tasks import accuracy


def test_the_target_domain_is_the_other_half_on_a_background_without_digit_labels():
    data = load_dann_digits(seed=3, n_test=100)
    train_x, train_y, test_x, test_y = load_mnist_sample(3, 100)
    half = len(train_y) // 2
    target = data.train_x[half:]
    assert torch.equal(data.train_x[:half], train_x[:half])
    assert bool((target >= train_x[half:]).all())  # the digit's strokes kept (the brighter pixel)
    background = target[train_x[half:] == 0].float()  # where the digit is black: the texture alone
    assert 40 < background.mean().item() < 120 and background.max().item() <= 160
    digit, domain = data.train_y["digit"], data.train_y["domain"]
    assert torch.equal(digit[:half], train_y[:half]) and bool((digit[half:] == -100).all())
    assert domain.tolist() == [0] * half + [1] * (len(train_y) - half)
    assert bool((data.test_x >= test_x).all()) and torch.equal(data.test_y["digit"], test_y)


def test_ignored_labels_are_left_out_of_the_loss_and_the_accuracy():
    logits = torch.tensor([[2.0, 0.0], [0.0, 2.0], [2.0, 0.0], [0.0, 2.0]])
    target = torch.tensor([0, 0, -100, -100])
    assert accuracy(logits, target).item() == 0.5  # 1 right of the 2 labelled
    assert accuracy(logits, torch.full((4,), -100)).item() == 0.0  # none labelled
    assert F.cross_entropy(logits, target) == F.cross_entropy(logits[:2], target[:2])


def test_grl_reverses_only_the_domain_heads_gradient_into_the_features():
    torch.manual_seed(0)
    x = torch.rand(4, 1, 28, 28)
    plain, reversed_ = DANNNet(), DANNNet()
    reversed_.load_state_dict(plain.state_dict())
    hooks = attach(reversed_, {"grl": {"modules": "domain.reverse", "transforms": [{"name": "scale", "factor": -0.5}]}})
    for m in (plain, reversed_):
        out = m(x)
        (out["digit"].sum() + out["domain"].sum()).backward()
    # the heads' own gradients are unchanged; the features get digit - 0.5 * domain
    assert torch.equal(plain.domain.fc.weight.grad, reversed_.domain.fc.weight.grad)
    digit_only = DANNNet()
    digit_only.load_state_dict(plain.state_dict())
    digit_only(x)["digit"].sum().backward()
    want = digit_only.features.fc.weight.grad * 1.5 - plain.features.fc.weight.grad * 0.5
    torch.testing.assert_close(reversed_.features.fc.weight.grad, want)
    hooks.remove()


def test_the_experiment_composes_with_the_ramp():
    cfg = compose_config("experiment=dann")
    assert cfg.model.name == "dann" and cfg.data.name == "dann_digits"
    assert dict(cfg.hooks.grl.transforms[0].factor) == {"schedule": "dann", "start": 0.0, "end": -0.3, "gamma": 10}
