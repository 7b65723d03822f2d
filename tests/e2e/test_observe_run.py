"""A tiny training run with `log -> clamp -> log`, TensorBoard and Grad-CAM: the logged
numbers equal what an independent recorder saw, the event files hold the expected tags,
the plots are written, and host reads grow by one per log point, not per step."""

from __future__ import annotations

import json
import sys
from collections import defaultdict

import matplotlib.image as mpimg
import numpy as np
import pytest
import torch
from helpers import FAST, compose_config

import gradmod.run.runner as train_mod
from gradmod.app.cli import run

CLIP = 0.01
# 1000 training digits in batches of 100: 10 steps. One thread: the test machines are
# shared, and oversubscribed threads slow tiny convolutions more than they help.
SMALL = [
    *FAST,
    "data.n_test=4000",
    "+hooks=clip_logged",
    "logger=tensorboard",
    "capture.gradcam=true",
    "capture.gradcam_images=4",
    "trainer.threads=1",
]


@pytest.fixture(autouse=True, scope="module")
def _restore_threads():
    threads = torch.get_num_threads()  # trainer.threads sets it for the whole process
    yield
    torch.set_num_threads(threads)


def _cfg(*overrides):
    return compose_config(*SMALL, *overrides)


@pytest.fixture(scope="module")
def logged_run(tmp_path_factory):
    """log_every=1, with recorder hooks registered before and after gradmod's chain."""
    out = tmp_path_factory.mktemp("run")
    seen = {"pre": defaultdict(list), "post": defaultdict(list)}
    real_attach = train_mod.attach

    def recording_attach(model, rules, stage="hook", **kwargs):
        def recorder(where, name):
            return lambda g: seen[where][name].append(g.detach().double().numpy().copy())

        for n, p in model.named_parameters():  # tensor hooks run in registration order
            p.register_hook(recorder("pre", n))
        hooks = real_attach(model, rules, stage, **kwargs)
        for n, p in model.named_parameters():
            p.register_hook(recorder("post", n))
        return hooks

    mp = pytest.MonkeyPatch()
    mp.setattr(train_mod, "attach", recording_attach)
    try:
        summary = run(_cfg("trainer.log_every=1"), out)
    finally:
        mp.undo()
    return out, summary, seen


def test_logged_pre_post_equal_an_independent_recorder(logged_run):
    out, summary, seen = logged_run
    lines = [json.loads(line) for line in open(out / "grad_stats.jsonl")]
    assert [r["step"] for r in lines] == list(range(1, summary["steps"] + 1)) and summary["steps"] == 10
    fracs = []
    for r in lines:
        i = r["step"] - 1
        for name in seen["pre"]:
            pre, post = seen["pre"][name][i], seen["post"][name][i]
            np.testing.assert_allclose(post, np.clip(pre, -CLIP, CLIP), rtol=1e-6)
            frac = float(np.mean(np.abs(pre) > CLIP))
            s_pre, s_post = r["stats"][f"{name}/pre"], r["stats"][f"{name}/post"]
            assert s_post["frac_clipped"] == pytest.approx(frac, abs=1e-6)
            assert s_pre["norm"] == pytest.approx(np.linalg.norm(pre), rel=1e-5)
            assert s_post["norm"] == pytest.approx(np.linalg.norm(np.clip(pre, -CLIP, CLIP)), rel=1e-5)
            assert "histogram" not in s_pre  # histograms go to TensorBoard, not the JSON files
            fracs.append(frac)
    assert 0.05 < np.mean(fracs) < 0.95  # clamp really clipped some, not all


def test_tensorboard_events_hold_the_expected_tags_and_values(logged_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, summary, seen = logged_run
    ea = EventAccumulator(
        str(out / "tensorboard"), size_guidance={"scalars": 0, "histograms": 0, "images": 0, "tensors": 0}
    )
    ea.Reload()
    tags = ea.Tags()
    names = list(seen["pre"])
    assert {"loss/train", "loss/test", "accuracy/test"} <= set(tags["scalars"])
    for n in names:
        assert {f"grad_norm/{n}/pre", f"grad_norm/{n}/post", f"frac_clipped/{n}"} <= set(tags["scalars"])
        assert {f"grad/{n}/pre", f"grad/{n}/post"} <= set(tags["histograms"])
    assert tags["images"] == ["gradcam"] and "hook_plan/text_summary" in tags["tensors"]
    plan = ea.Tensors("hook_plan/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "clip_logged: log(label=pre) -> clamp(min=-0.01, max=0.01) -> log(label=post)" in plan

    # Values: the same numbers as the JSON files and the recorder.
    lines = {r["step"]: r["stats"] for r in map(json.loads, open(out / "grad_stats.jsonl"))}
    norms = ea.Scalars("grad_norm/conv2.weight/post")
    assert [e.step for e in norms] == sorted(lines)
    for e in norms:
        assert e.value == pytest.approx(lines[e.step]["conv2.weight/post"]["norm"], rel=1e-6)
    final = json.loads(open(out / "metrics.jsonl").readlines()[-1])
    assert ea.Scalars("accuracy/test")[-1].value == pytest.approx(final["test_accuracy"])
    for e in ea.Histograms("grad/l1.weight/pre"):
        pre = seen["pre"]["l1.weight"][e.step - 1]
        h = e.histogram_value
        assert h.num == pre.size and sum(h.bucket) == pre.size
        assert (h.min, h.max) == pytest.approx((pre.min(), pre.max()), rel=1e-6)
        assert h.sum_squares == pytest.approx(np.sum(pre**2), rel=1e-4)
    post = ea.Histograms("grad/l1.weight/post")[-1].histogram_value
    assert post.max <= CLIP + 1e-9 and post.min >= -CLIP - 1e-9
    images = ea.Images("gradcam")
    assert len(images) == summary["epochs"] and (images[0].height, images[0].width) == (28, 4 * 28)


def test_end_of_run_pngs_are_written_and_not_blank(logged_run):
    out, _, _ = logged_run
    for name in ("curves.png", "grad_norms.png", "frac_clipped.png", "gradcam.png"):
        img = mpimg.imread(out / name)
        assert img.shape[0] > 100 and img.shape[1] > 100, name
        assert img[..., :3].std() > 0.05, f"{name} looks blank"


def _count_host_reads(monkeypatch):
    """Count device-to-host reads made by gradmod's own code (torch's own CPU-side
    reads, e.g. Adam's step counter, are not syncs on a GPU and are not counted). The
    statistics take the path they take on a GPU: no read that is free only on the CPU."""
    from gradmod.hooks.mesh import devices

    monkeypatch.setattr(devices, "_ACCELERATOR_PATHS", [True])
    counts = {"n": 0}
    for method in ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__"):
        original = getattr(torch.Tensor, method)

        def wrapper(self, *a, _original=original, **k):
            if sys._getframe(1).f_globals.get("__name__", "").startswith("gradmod"):
                counts["n"] += 1
            return _original(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, method, wrapper)
    return counts


def test_host_reads_grow_by_one_per_log_point_not_per_step(tmp_path, monkeypatch):
    # Random 28x28 digits, 200 in batches of 10: 20 cheap steps.
    tiny = [
        "data=fake",
        "data.image_size=28",
        "data.channels=1",
        "data.train_size=200",
        "data.test_size=20",
        "data.batch_size=10",
    ]
    cfg_dense, cfg_sparse = _cfg(*tiny, "trainer.log_every=4"), _cfg(*tiny, "trainer.log_every=20")
    counts = _count_host_reads(monkeypatch)
    run(cfg_dense, tmp_path / "dense")  # reads at steps 4, 8, 12, 16, 20
    dense = counts["n"]
    counts["n"] = 0
    run(cfg_sparse, tmp_path / "sparse")  # one read, at step 20
    sparse = counts["n"]
    assert dense - sparse == 4
    # Twice the steps, still one log point: a read per step would add 20 reads.
    counts["n"] = 0
    run(_cfg(*tiny, "data.train_size=400", "trainer.log_every=40"), tmp_path / "long")
    assert counts["n"] == sparse
    assert len(open(tmp_path / "dense" / "grad_stats.jsonl").readlines()) == 5


def test_run_without_hooks_writes_csv_and_gradcam_but_no_gradient_plots(tmp_path):
    cfg = compose_config(
        *FAST,
        "data=fake",
        "data.image_size=28",
        "data.channels=1",
        "data.train_size=40",
        "data.test_size=20",
        "data.batch_size=10",
        "capture.gradcam=true",
        "capture.gradcam_images=3",
        "trainer.threads=1",
    )
    run(cfg, tmp_path)  # no hooks at all: an empty `hooks` config must work
    assert (tmp_path / "gradcam.png").stat().st_size > 0 and (tmp_path / "metrics.csv").exists()
    assert not (tmp_path / "grad_norms.png").exists() and not (tmp_path / "tensorboard").exists()
