"""Claims a run makes (an epsilon, a noise multiplier) hold for what it did, and refusals of
those that would not: each against a case that made a false claim."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_mlp

from gradmod.hooks import attach

NOISY = {"name": "per_sample_clip", "max_norm": 1.0, "noise_multiplier": 1.0}


@pytest.mark.parametrize(
    "second",
    [
        {"params": "2.*", "stage": "per_sample", "transforms": ["log"]},  # logs only
        {"params": "2.*", "transforms": [{"name": "per_sample_clip", "max_norm": 1.0}]},  # clips, no noise
    ],
    ids=["log_only", "clip_without_noise"],
)
def test_a_second_per_sample_rule_without_noise_is_refused_in_one_line(second):
    model = tiny_mlp(4, 8, 3)
    rules = {"dp": {"params": "0.*", "transforms": [NOISY]}, "other": second}
    with pytest.raises(ValueError) as e:
        attach(model, rules)
    line = str(e.value)
    assert "\n" not in line and "privacy claim is false" in line
    assert "2.weight (rule other, no noise)" in line and "2.bias (rule other, no noise)" in line


def test_the_noisy_rule_over_every_parameter_still_trains():
    model = tiny_mlp(4, 8, 3)
    with attach(model, {"dp": {"params": "*", "transforms": [NOISY]}}) as hooks:
        torch.nn.functional.cross_entropy(model(torch.randn(5, 4)), torch.tensor([0, 1, 2, 0, 1])).backward()
        hooks.after_backward()
    assert all(p.grad is not None for p in model.parameters())
