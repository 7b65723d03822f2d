"""Claims a run makes (an epsilon, a noise multiplier) hold for what it did, and refusals of
those that would not: each against a case that made a false claim."""

from __future__ import annotations

import re

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


try:
    import opacus  # noqa: F401
except ImportError:
    opacus = None


needs_opacus = pytest.mark.skipif(opacus is None, reason="the privacy extra: pip install 'gradmod[privacy]'")


@needs_opacus
def test_the_summary_names_every_noise_multiplier_the_epsilon_rests_on():
    from gradmod.training.privacy import PrivacyCallback, epsilon_of

    first = PrivacyCallback("rdp", 1e-5, 1.1, 0.1)
    for _ in range(30):
        first.on_step_end(None)
    assert first.summary()["noise_multiplier"] == 1.1
    later = PrivacyCallback("rdp", 1e-5, 0.8, 0.1)  # a resume whose steps get other noise
    later.load_state_dict(first.state_dict())
    for _ in range(20):
        later.on_step_end(None)
    block = later.summary()
    assert block["noise_multiplier"] == [1.1, 0.8]
    assert block["history"] == [[1.1, 0.1, 30], [0.8, 0.1, 20]]
    assert block["epsilon"] == pytest.approx(epsilon_of([(1.1, 0.1, 30), (0.8, 0.1, 20)], 1e-5, "rdp"))


@needs_opacus
@pytest.mark.slow  # two DP runs
def test_a_target_epsilon_resume_names_the_noise_it_applies(tmp_path, caplog):
    import json

    from helpers import TINY_FAKE, compose_config

    from gradmod.app.cli import run

    tiny = [o for o in TINY_FAKE if not o.startswith("trainer.epochs")]
    target = [*tiny, "+hooks=dp", "hooks.dp.transforms=[{name: per_sample_clip, max_norm: 1.0}]"]
    target += ["privacy.target_epsilon=4", "privacy.delta=1e-3"]
    first = run(compose_config(*target, "trainer.epochs=1"), tmp_path)
    sigma = first["privacy"]["noise_multiplier"]

    caplog.clear()
    with caplog.at_level("INFO"):
        second = run(compose_config(*target, "trainer.epochs=2", "trainer.resume=auto"), tmp_path)

    def named(plan_text: str) -> set[float]:  # per_sample_clip(max_norm=1.0, noise_multiplier=0.81...)
        return {float(v) for v in re.findall(r"noise_multiplier=([0-9.e+-]+)", plan_text)}

    plan = (tmp_path / "hook_plan.json").read_text()
    assert named(plan) == named(json.dumps(second["hook_plan"])) == {sigma}  # the noise the steps got, not a new plan's
    block = second["privacy"]
    assert block["noise_multiplier"] == sigma and {s for s, _, _ in block["history"]} == {sigma}
    assert block["steps"] == 2 * first["privacy"]["steps"]
    said = [float(v) for r in caplog.records for v in re.findall(r"noise_multiplier[= ]([0-9.]+)", r.getMessage())]
    assert said and all(round(v, 4) == round(sigma, 4) for v in said)
