"""DP-SGD in a loop of one's own: ``gradmod.PoissonSampler`` draws each example with rate q,
``gradmod.Accountant`` / ``gradmod.epsilon`` report what ``python train.py +hooks=dp``
reports for the same steps, noise, rate and delta; bad arguments are one line."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from helpers import TINY_FAKE, compose_config
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import gradmod
from gradmod.hooks.stage import Loop

pytest.importorskip("opacus", reason="the privacy extra: pip install 'gradmod[privacy]'")


def test_the_sampler_draws_each_example_independently_with_rate_q():
    sampler = gradmod.PoissonSampler(50, 0.2, 400, torch.Generator().manual_seed(0))
    batches = list(sampler)
    assert len(batches) == len(sampler) == 400
    counts = torch.zeros(50)
    for b in batches:
        assert len(set(b)) == len(b) and all(0 <= i < 50 for i in b)
        counts[b] += 1
    # each example joins a step with probability 0.2: 80 of 400 expected, sd 8
    assert (counts - 80).abs().max() < 5 * 8 and abs(counts.mean() - 80) < 3
    assert any(len(b) == 0 for b in gradmod.PoissonSampler(5, 0.05, 200, torch.Generator().manual_seed(1)))


def plain_loop() -> gradmod.Accountant:
    """DP-SGD outside the trainer: 60 examples, expected batch 10, sigma 1.1, C 1, 6 steps."""
    torch.manual_seed(0)
    x, y = torch.randn(60, 8), torch.randint(0, 3, (60,))
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    rules = {
        "dp": {"params": "*", "transforms": [{"name": "per_sample_clip", "max_norm": 1.0, "noise_multiplier": 1.1}]}
    }
    hooks = gradmod.attach(model, rules)
    q = 10 / 60
    hooks.set_up(Loop(poisson=True, step_examples=10))  # divide by the expected batch, q * 60
    accountant = gradmod.Accountant(delta=1e-5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(
        TensorDataset(x, y), batch_sampler=gradmod.PoissonSampler(60, q, 6, torch.Generator().manual_seed(0))
    )
    for xb, yb in loader:
        opt.zero_grad()
        F.cross_entropy(model(xb), yb).backward()  # an empty batch too: zero gradients plus the noise
        hooks.after_backward()
        opt.step()
        accountant.step(noise_multiplier=1.1, sample_rate=q)
    assert accountant.steps == 6 and all(torch.isfinite(p).all() for p in model.parameters())
    return accountant


def test_a_plain_loop_accounts_its_steps():
    from opacus.accountants import RDPAccountant

    ref = RDPAccountant()
    for _ in range(6):
        ref.step(noise_multiplier=1.1, sample_rate=10 / 60)
    assert plain_loop().epsilon() == pytest.approx(ref.get_epsilon(1e-5), rel=1e-12)


@pytest.mark.slow
def test_a_plain_loop_reports_the_trainers_epsilon(tmp_path):
    from gradmod.app.cli import run

    summary = run(compose_config(*TINY_FAKE, "+hooks=dp", "trainer.epochs=1"), tmp_path)
    block = summary["privacy"]
    accountant, q = plain_loop(), 10 / 60
    assert (block["steps"], block["sample_rate"], block["noise_multiplier"]) == (6, pytest.approx(q), 1.1)
    assert accountant.epsilon() == pytest.approx(block["epsilon"], rel=1e-12)
    assert gradmod.epsilon(6, q, 1.1, 1e-5) == pytest.approx(block["epsilon"], rel=1e-12)
    metrics = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["epsilon"] == pytest.approx(accountant.epsilon(), rel=1e-12)
    # the plan names each parameter's path once the first step has set the stage up
    plan = json.loads((tmp_path / "hook_plan.json").read_text())
    assert plan and all(row["path"] in ("closed form", "Gram") for row in plan), plan


def test_every_opacus_accountant_and_the_history_of_changing_noise():
    from opacus.accountants import PRVAccountant

    acc = gradmod.Accountant(delta=1e-5, accountant="prv")
    acc.step(1.0, 0.01, steps=50)
    acc.step(1.0, 0.01, steps=50)  # merged, as Opacus keeps it
    acc.step(2.0, 0.02, steps=10)
    assert acc.history == [(1.0, 0.01, 100), (2.0, 0.02, 10)] and acc.steps == 110
    ref = PRVAccountant()
    ref.history = [(1.0, 0.01, 100), (2.0, 0.02, 10)]
    assert acc.epsilon() == pytest.approx(ref.get_epsilon(1e-5), rel=1e-9)
    assert 0 < gradmod.epsilon(100, 0.01, 1.0, 1e-5, "gdp") and gradmod.Accountant(1e-5).epsilon() == 0.0


@pytest.mark.parametrize(
    "call, words",
    [
        (lambda: gradmod.epsilon(10, 0.0, 1.0, 1e-5), "sample_rate=0.0; allowed: (0, 1]"),
        (lambda: gradmod.epsilon(10, 0.1, 0.0, 1e-5), "noise_multiplier=0.0; allowed: a finite number > 0"),
        (lambda: gradmod.epsilon(10, 0.1, 1.0, 1.5), "delta=1.5; allowed: a number in (0, 1)"),
        (lambda: gradmod.epsilon(-1, 0.1, 1.0, 1e-5), "steps=-1; allowed: an int >= 0"),
        (lambda: gradmod.epsilon(10, 0.1, 1.0, 1e-5, "moments"), "accountant='moments'; allowed: gdp, prv, rdp"),
        (lambda: gradmod.PoissonSampler(0, 0.1, 5), "num_examples=0; allowed: an int > 0"),
    ],
)
def test_bad_arguments_are_one_line(call, words):
    with pytest.raises(ValueError) as err:
        call()
    assert words in str(err.value) and "\n" not in str(err.value)
