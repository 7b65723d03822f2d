"""The `log` transform before and after (pre/post), histograms, loggers, Grad-CAM wiring:
checked against independent computations on small models."""

from __future__ import annotations

import csv
import sys

import numpy as np
import pytest
import torch
from torch import nn

from gradmod.data import Data
from gradmod.hooks import attach
from gradmod.hooks.rules.targets import build_targets
from gradmod.hooks.stats.grad_stats import GradStats
from gradmod.reporting.loggers import CSVLogger, make_logger
from gradmod.reporting.observe import GradCamProbe, pick_digits

CLIP = 0.01
LOGGED = {"c": {"params": "*", "transforms": ["log", {"name": "clamp", "min": -CLIP, "max": CLIP}, "log"]}}


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.zeros(6, 5))
        self.b = nn.Parameter(torch.zeros(7))


def _labels(rules):
    return [
        [s.fn.label if isinstance(s.fn, GradStats) else s.name for s in t.steps] for t in build_targets(Tiny(), rules)
    ][0]


def test_log_first_and_last_are_labelled_pre_and_post():
    assert _labels({"r": {"params": "a", "transforms": ["log"]}}) == [None]
    assert _labels({"r": {"params": "a", "transforms": ["log", "zero", "log"]}}) == ["pre", "zero", "post"]
    assert _labels({"r": {"params": "a", "transforms": ["zero", "log"]}}) == ["zero", "post"]
    explicit = {"r": {"params": "a", "transforms": [{"name": "log", "label": "raw"}, "zero", "log"]}}
    assert _labels(explicit) == ["raw", "zero", "post"]
    hooks = attach(Tiny(), LOGGED)
    assert "log(label=pre) -> clamp(min=-0.01, max=0.01) -> log(label=post)" in hooks.format_plan()
    hooks.remove()


def test_two_rules_logging_one_tensor_under_one_key_is_an_error():
    rules = {"x": {"params": "a", "transforms": ["log"]}, "y": {"params": "*", "transforms": ["log"]}}
    with pytest.raises(ValueError, match=r"hooks\.y: .*'a'.*label"):
        build_targets(Tiny(), rules)
    rules["y"]["transforms"] = [{"name": "log", "label": "again"}]
    assert len(build_targets(Tiny(), rules)) == 3


@pytest.mark.parametrize("stage", ["hook", "fused"])
def test_pre_post_norms_and_fraction_clipped_equal_numpy(stage):
    model = Tiny()
    hooks = attach(model, LOGGED, stage=stage)
    rng = np.random.default_rng(0)
    given = [
        {n: rng.normal(0, 0.012, tuple(p.shape)).astype(np.float32) for n, p in model.named_parameters()}
        for _ in range(2)
    ]
    for g in given:  # two optimizer steps in one window: the stats are means over the calls
        model.zero_grad(set_to_none=True)
        sum((p * torch.from_numpy(g[n])).sum() for n, p in model.named_parameters()).backward()
        hooks.after_backward()
        for n, p in model.named_parameters():  # the clamp really ran
            np.testing.assert_allclose(p.grad.numpy(), np.clip(g[n], -CLIP, CLIP))
    stats = hooks.read_stats()
    assert sorted(stats) == ["a/post", "a/pre", "b/post", "b/pre"]
    for n in ("a", "b"):
        pre = [g[n].astype(np.float64) for g in given]
        post = [np.clip(x, -CLIP, CLIP) for x in pre]
        frac = np.mean([np.mean(np.abs(x) > CLIP) for x in pre])
        assert 0.2 < frac < 0.8  # the gradient was chosen so the check means something
        assert stats[f"{n}/post"]["frac_clipped"] == pytest.approx(frac, abs=1e-6)
        assert stats[f"{n}/pre"]["norm"] == pytest.approx(np.mean([np.linalg.norm(x) for x in pre]), rel=1e-5)
        assert stats[f"{n}/post"]["norm"] == pytest.approx(np.mean([np.linalg.norm(x) for x in post]), rel=1e-5)
        assert stats[f"{n}/post"]["max"] == pytest.approx(min(CLIP, max(x.max() for x in pre)))
        assert "frac_clipped" not in stats[f"{n}/pre"] and stats[f"{n}/pre"]["calls"] == 2
    hooks.remove()


def test_fraction_changed_by_min_zero_counts_negatives_not_zeros():
    # ReLU nets give many exact-zero gradients: "at the bound after" would count them as
    # clipped; comparing with the pre gradient does not.
    model = Tiny()
    hooks = attach(model, {"m": {"params": "a", "transforms": ["log", "min_zero", "log"]}})
    g = torch.tensor([[-1.0, 0.0, 0.0, 2.0, -3.0]] * 6)
    (model.a * g).sum().backward()
    assert hooks.read_stats()["a/post"]["frac_clipped"] == pytest.approx(2 / 5)
    hooks.remove()


def test_histogram_on_the_device_equals_numpy():
    rng = np.random.default_rng(1)
    lo, hi, bins = -1.0, 2.0, GradStats.BINS
    edges = np.linspace(lo, hi, bins + 1)
    x = rng.uniform(lo, hi, 5000)
    x = x[np.min(np.abs(x[:, None] - edges[None, :]), axis=1) > 1e-4]  # float32 rounding at edges
    values = np.concatenate([[lo, hi], x]).astype(np.float32)
    g = torch.from_numpy(np.concatenate([values, [np.nan, np.inf, -np.inf]]).astype(np.float32))
    out = GradStats.summarize(1, [0.0] * 7 + GradStats.bin(g).tolist())["histogram"]
    counts, _ = np.histogram(values, edges)
    assert out["bucket_counts"] == counts.tolist()
    np.testing.assert_allclose(out["bucket_limits"], edges[1:], rtol=1e-6)
    assert out["num"] == len(values) and (out["min"], out["max"]) == (lo, hi)
    assert out["sum"] == pytest.approx(values.astype(np.float64).sum(), rel=1e-4)
    assert out["sum_squares"] == pytest.approx((values.astype(np.float64) ** 2).sum(), rel=1e-4)


def test_histograms_only_when_asked_and_read_with_the_window():
    model = Tiny()
    hooks = attach(model, LOGGED)
    for want in (False, True, False):
        hooks.set_histograms(want)
        model.zero_grad()
        (model.a.sum() * 0.5 + model.b.sum()).backward()
        stats = hooks.read_stats()
        assert all(("histogram" in s) == want for s in stats.values())
    # a constant gradient: one full bucket, increasing limits
    hooks.set_histograms(True)
    (model.a.sum() * 0.5).backward()
    h = hooks.read_stats()["a/pre"]["histogram"]
    assert h["bucket_counts"][0] == 30 and sum(h["bucket_counts"]) == 30 and h["min"] == h["max"] == 0.5
    assert np.all(np.diff(h["bucket_limits"]) > 0)
    hooks.remove()


def test_csv_logger_writes_rows(tmp_path):
    logger = make_logger({"name": "csv"}, tmp_path)
    assert isinstance(logger, CSVLogger)
    logger.log_stats(1, 10, {"a/pre": {"norm": 2.0, "calls": 3}, "a/post": {"norm": 1.0, "frac_clipped": 0.25}})
    logger.log_metrics(10, {"epoch": 1, "step": 10, "train_loss": 0.5, "grad_stats": {"x": {}}})
    logger.close()
    rows = list(csv.DictReader(open(tmp_path / "grad_stats.csv")))
    assert [(r["tensor"], r["label"], r["norm"], r["frac_clipped"]) for r in rows] == [
        ("a", "pre", "2.0", ""),
        ("a", "post", "1.0", "0.25"),
    ]
    assert list(csv.DictReader(open(tmp_path / "metrics.csv"))) == [{"epoch": "1", "step": "10", "train_loss": "0.5"}]


def test_logger_config_errors_name_the_key(tmp_path):
    with pytest.raises(ValueError, match=r"logger\.name='wandb'.*allowed: csv, tensorboard"):
        make_logger({"name": "wandb"}, tmp_path)
    with pytest.raises(ValueError, match=r"logger=csv got unknown key\(s\) histograms"):
        make_logger({"name": "csv", "histograms": True}, tmp_path)


def test_tensorboard_requested_but_not_installed(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # None in sys.modules: import fails
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(
        ValueError, match=r"logger\.name=tensorboard needs the tensorboard package.*gradmod\[tensorboard\]"
    ):
        make_logger({"name": "tensorboard"}, tmp_path)


def _data(n_test=30):
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (n_test, 1, 28, 28), dtype=torch.uint8, generator=g)
    return Data("fake", x, torch.arange(n_test) % 10, x, torch.arange(n_test).flip(0) % 10)


def test_pick_digits_takes_classes_in_turn():
    y = torch.tensor([3, 1, 1, 0, 3, 0, 2])
    assert pick_digits(y, 5) == [3, 1, 6, 0, 5]
    assert pick_digits(y, 100) == [3, 1, 6, 0, 5, 2, 4]


def test_gradcam_probe_checks_its_config():
    with pytest.raises(
        ValueError, match=r"capture\.gradcam_layer='conv3' is not a module of model mnist_cnn; close names: conv"
    ):
        GradCamProbe("mnist_cnn", _data(), "conv3", 4, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"capture\.gradcam_images=0 must be an integer >= 1"):
        GradCamProbe("mnist_cnn", _data(), "conv2", 0, torch.device("cpu"))


def test_gradcam_probe_ignores_the_runs_hooks():
    from gradmod.capture import grad_cam
    from gradmod.models import build_model

    torch.manual_seed(0)
    model = build_model("mnist_cnn")
    data = _data()
    probe = GradCamProbe("mnist_cnn", data, "conv2", 4, torch.device("cpu"))
    # A run's hooks: an output hook after conv2 that would change Grad-CAM, and observers.
    hooks = attach(model, {"z": {"modules": "l1", "transforms": ["log", "zero"]}})
    got = probe(model)
    assert hooks.read_stats() == {}  # Grad-CAM's backward did not reach the run's observers
    hooks.remove()
    expected = grad_cam(model.eval(), "conv2", probe.x)
    np.testing.assert_allclose(got["cams"], expected.numpy(), rtol=1e-5, atol=1e-7)
    assert got["labels"] == data.test_y[pick_digits(data.test_y, 4)].tolist()
    assert got["cams"].shape == got["images"].shape == (4, 28, 28) and got["cams"].max() > 0
