"""Each group's learning rate by name (and Muon's adjusted one) in the epoch line and the metrics."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from helpers import TINY_FAKE, compose_config

import gradmod
from gradmod.app.cli import run
from gradmod.models import MnistCNN, TinyGPT
from gradmod.optim.rates import group_rates

muon = pytest.importorskip("torch.optim._muon", reason="torch.optim.Muon")


def test_rates_by_name_and_muons_adjusted_rate_as_torch_adjusts_it():
    model = TinyGPT(65)
    spec = {
        "_target_": "torch.optim.AdamW",
        "lr": 3e-4,
        "groups": [
            {"params": "@embeddings", "lr": 0.1},
            {"params": "@matrices", "optimizer": {"_target_": "gradmod.optim.Muon", "lr": 0.02}},
        ],
    }
    opt = gradmod.optimizer(model, spec)
    rates = group_rates(opt)
    matrices = opt.optimizers[1].param_groups[0]["params"]
    largest = max(muon._adjust_lr(0.02, None, p.shape) for p in matrices)  # torch's own adjustment
    assert rates == {"adamw": 3e-4, "adamw.groups.0": 0.1, "muon": 0.02, "muon.adjusted": largest}
    assert largest == 0.02 * 2  # fc1: 256 x 64


def test_a_kernels_and_a_splits_adjusted_rate_read_the_matrix_muon_orthogonalises():
    cnn = MnistCNN(1, 10)
    opt = gradmod.optimizer(
        cnn,
        {
            "_target_": "torch.optim.AdamW",
            "groups": [
                {
                    "params": "conv2.weight",
                    "optimizer": {"_target_": "gradmod.optim.Muon", "lr": 0.02, "adjust_lr_fn": "match_rms_adamw"},
                }
            ],
        },
    )
    kernel = cnn.conv2.weight
    flat = torch.Size([kernel.shape[0], kernel[0].numel()])
    assert group_rates(opt)["muon.adjusted"] == muon._adjust_lr(0.02, "match_rms_adamw", flat)
    layer = torch.nn.Sequential(torch.nn.Linear(8, 24, bias=False))
    opt = gradmod.optimizer(
        layer,
        {
            "_target_": "torch.optim.SGD",
            "groups": [{"params": "0.weight", "optimizer": {"_target_": "gradmod.optim.Muon", "lr": 0.02, "split": 3}}],
        },
    )
    # Muon alone holds the layer: its group is entry 0's
    assert group_rates(opt)["muon.groups.0.adjusted"] == muon._adjust_lr(0.02, None, torch.Size([8, 8]))


def test_the_epoch_line_and_metrics_show_each_groups_rate(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    run(compose_config(*TINY_FAKE, "optimizer=muon", "trainer.epochs=1", "trainer.checkpoint_every_steps=0"), tmp_path)
    record = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    kernels = [MnistCNN(1, 10).conv1.weight, MnistCNN(1, 10).conv2.weight]
    adjusted = max(muon._adjust_lr(0.02, None, torch.Size([k.shape[0], k[0].numel()])) for k in kernels)
    assert record["lr_groups"] == {"adamw": 3e-4, "muon": 0.02, "muon.adjusted": adjusted}
    line = f"lr adamw=0.0003 muon=0.02 muon.adjusted={adjusted:.4g}"
    assert any(line in r.getMessage() for r in caplog.records)
