"""Learning-rate schedules, parameter groups and the optimizer's kernel choice."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from torch import nn

import gradmod
from gradmod.app.cli import run
from gradmod.models import MnistCNN
from gradmod.run.config import AdamConfig, SGDConfig
from gradmod.run.factories import build_scheduler, default_fused, model_optimizer
from gradmod.run.folder import checkpoint_file as ckpt

TINY = [
    "data=fake",
    "data.image_size=28",
    "data.channels=1",
    "data.train_size=60",
    "data.test_size=20",
    "data.batch_size=10",
    "trainer.epochs=2",
    "trainer.device=cpu",
    "trainer.progress=false",
]


def _lrs(scheduler, optimizer, n):
    out = []
    for _ in range(n):
        optimizer.step()
        scheduler.step()
        out.append(optimizer.param_groups[0]["lr"])
    return out


@pytest.mark.parametrize("name", ["cosine", "step", "onecycle", "warmup_cosine"])
def test_shipped_schedules_match_torch(compose_cfg, name):
    from gradmod.app.config_store import validate

    cfg = validate(compose_cfg("scheduler=" + name, "scheduler.step_size=7" if name == "step" else "seed=1"))
    p = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.1)
    ours = _lrs(build_scheduler(cfg.scheduler, opt, total_steps=60), opt, 60)
    q = nn.Parameter(torch.zeros(1))
    ref_opt = torch.optim.SGD([q], lr=0.1)
    lr = torch.optim.lr_scheduler
    ref = {
        "cosine": lambda: lr.CosineAnnealingLR(ref_opt, T_max=60),
        "step": lambda: lr.StepLR(ref_opt, step_size=7, gamma=0.5),
        "onecycle": lambda: lr.OneCycleLR(ref_opt, max_lr=0.01, total_steps=60, pct_start=0.3),
        "warmup_cosine": lambda: lr.SequentialLR(
            ref_opt, [lr.LinearLR(ref_opt, 0.01, 1.0, total_iters=20), lr.CosineAnnealingLR(ref_opt, T_max=40)], [20]
        ),
    }[name]()
    assert ours == _lrs(ref, ref_opt, 60)
    assert len(set(ours)) > 3  # the rate really moves


def test_onecycle_says_in_one_line_that_it_drops_an_entrys_lr_scale(compose_cfg, caplog):
    """OneCycleLR sets every group's rate from max_lr: an entry's lr_scale is lost, and the run says so."""
    from gradmod.app.config_store import validate

    spec = {"_target_": "torch.optim.SGD", "lr": 0.1, "groups": [{"params": "@last_layer", "lr_scale": 0.1}]}

    def warnings(*over):
        cfg = validate(compose_cfg("scheduler=onecycle", *over))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="gradmod"):
            build_scheduler(cfg.scheduler, gradmod.optimizer(MnistCNN(1, 10), spec), total_steps=60)
        return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]

    assert warnings() == [
        "scheduler: OneCycleLR sets every group's rate from max_lr=0.01, so optimizer.groups.0's lr_scale=0.1 is "
        "not applied; give max_lr a list, one rate per group (2 groups, in the order of the printed optimizer groups)"
    ]
    assert warnings("scheduler.max_lr=[0.01,0.001]") == []  # a rate per group: the user's own ratio
    cfg = validate(compose_cfg("scheduler=cosine"))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="gradmod"):
        build_scheduler(cfg.scheduler, gradmod.optimizer(MnistCNN(1, 10), spec), total_steps=60)
    assert not caplog.records  # its rates follow each group's initial one


def test_scheduled_run_resumes_bit_identical(compose_cfg, tmp_path):
    over = [*TINY, "scheduler=onecycle", "trainer.checkpoint_every_steps=4", "trainer.checkpoint_keep=10"]
    full = tmp_path / "full"
    run(compose_cfg(*over), full)
    mid = full / "checkpoints" / "step-000000008.pt"
    assert ckpt.load(mid)["callbacks"]["scheduler"]["last_epoch"] == 8
    summary = run(compose_cfg(*over, f"trainer.resume={mid}"), tmp_path / "resumed")
    assert summary["steps"] == 12
    a, b = torch.load(full / "model.pt"), torch.load(tmp_path / "resumed" / "model.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)
    records = [json.loads(ln) for ln in (full / "metrics.jsonl").read_text().splitlines()]
    ref = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    ref_lrs = _lrs(torch.optim.lr_scheduler.OneCycleLR(ref, max_lr=0.01, total_steps=12, pct_start=0.3), ref, 12)
    assert [r["lr"] for r in records] == [ref_lrs[5], ref_lrs[11]]  # after steps 6 and 12


def test_no_decay_groups_and_their_errors():
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    opt = model_optimizer(AdamConfig(weight_decay=0.1, no_decay=["*.bias", "1.*"]), model)
    decayed, exempt = opt.param_groups
    assert decayed["weight_decay"] == 0.1 and exempt["weight_decay"] == 0.0
    assert [p is q for p, q in zip(decayed["params"], [model[0].weight, model[2].weight])] == [True, True]
    assert {id(p) for p in exempt["params"]} == {
        id(model[0].bias),
        id(model[1].weight),
        id(model[1].bias),
        id(model[2].bias),
    }
    with pytest.raises(ValueError, match=r"optimizer.no_decay: '\*bn\*' matches no parameter; .*1.bias"):
        model_optimizer(AdamConfig(no_decay=["*bn*"]), model)


def test_no_decay_from_the_config_reaches_the_run(compose_cfg, tmp_path):
    with pytest.raises(ValueError, match="optimizer.no_decay: 'nope' matches no parameter"):
        run(compose_cfg(*TINY, "optimizer.no_decay=[nope]"), tmp_path / "bad")
    base = run(compose_cfg(*TINY, "optimizer.weight_decay=0.5"), tmp_path / "a")
    exempt = run(compose_cfg(*TINY, "optimizer.weight_decay=0.5", "optimizer.no_decay=['*.bias']"), tmp_path / "b")
    a, b = torch.load(tmp_path / "a" / "model.pt"), torch.load(tmp_path / "b" / "model.pt")
    assert not torch.equal(a["conv1.bias"], b["conv1.bias"]) and base["steps"] == exempt["steps"]


@pytest.mark.parametrize("cfg", [AdamConfig(weight_decay=0.01), SGDConfig(momentum=0.9)])
def test_foreach_equals_the_per_tensor_loop(cfg):
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3))
    results = []
    for foreach in (True, False):
        model = __import__("copy").deepcopy(ref)
        cfg.foreach = foreach
        opt = model_optimizer(cfg, model)
        assert opt.defaults["foreach"] is foreach
        for i in range(5):
            opt.zero_grad()
            model(torch.randn(4, 5, generator=torch.Generator().manual_seed(i))).square().mean().backward()
            opt.step()
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b)


def test_fused_default_is_chosen_by_device():
    assert default_fused(torch.optim.Adam, torch.device("cuda")) is True
    assert default_fused(torch.optim.AdamW, torch.device("cuda:1")) is True
    assert default_fused(torch.optim.SGD, torch.device("cuda")) is True
    assert default_fused(torch.optim.RMSprop, torch.device("cuda")) is None  # no fused kernel: torch decides
    assert default_fused(torch.optim.Adam, torch.device("cpu")) is None
    assert model_optimizer(AdamConfig(), nn.Linear(2, 1)).defaults["fused"] is None
    with pytest.raises(ValueError, match="optimizer.fused=true with optimizer.foreach=true"):
        AdamConfig(fused=True, foreach=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="fused optimizers need CUDA")
def test_fused_adam_is_the_cuda_default():
    layer = nn.Linear(3, 1, device="cuda")
    assert model_optimizer(AdamConfig(), layer, device=layer.weight.device).defaults["fused"] is True
