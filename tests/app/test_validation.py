"""Bad input: one clear line on stderr, a non-zero exit, no traceback, before any training.

Every case goes through the real ``train.py``. Starting torch costs seconds per process,
so the default suite runs the whole table in one process (``tests/support/cli_driver.py`` runs
``train.py`` as ``__main__`` once per case) plus a few cases as separate processes;
``-m slow`` runs every case as its own ``python train.py`` process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import ROOT, run_train

BASE = ["data=mnist_sample", "trainer.device=cpu", "trainer.epochs=1", "trainer.progress=false"]
RULE = "+hooks.r={params: '*', transforms: [%s]}"
BAD_CONF = f"hydra.searchpath=[file://{ROOT / 'tests' / 'support' / 'bad_conf'}]"  # hook files with bad YAML values

# (overrides, words the one error line must contain: the key, the bad value, what is allowed)
CASES = [
    (["foo=1"], ["foo", "allowed", "trainer"]),
    (["+foo=1"], ["foo", "allowed", "seed"]),
    (["+trainer.epoch=3"], ["trainer.epoch", "allowed", "epochs"]),
    (["+data.train_size=5"], ["data.train_size", "allowed", "batch_size"]),
    (["trainer.epochs=abc"], ["trainer.epochs", "abc", "Integer"]),
    (["seed=abc"], ["seed", "abc", "Integer"]),
    (["optimizer.lr=abc"], ["optimizer.lr", "abc", "Float"]),
    (["trainer.compile=maybe"], ["trainer.compile", "maybe", "bool"]),
    (["model.name=???"], ["model.name", "missing"]),
    (["trainer.epochs=0"], ["trainer.epochs=0", ">= 1"]),
    (["data.batch_size=0"], ["data.batch_size=0", ">= 1"]),
    (["trainer.accumulate=0"], ["trainer.accumulate=0", ">= 1"]),
    (["trainer.checkpoint_every=-1"], ["trainer.checkpoint_every=-1", ">= 0"]),
    (["model=nope"], ["model=nope", "allowed", "mnist_cnn", "resnet18"]),
    (["model.name=nope"], ["model.name", "nope", "mnist_cnn"]),
    (["data=nope"], ["data=nope", "allowed", "mnist_sample"]),
    (["data.name=nope"], ["data.name", "nope", "mnist_sample"]),
    (["optimizer=nope"], ["optimizer=nope", "allowed", "adam", "sgd"]),
    (["init=nope"], ["init=nope", "allowed", "xavier"]),
    (["logger=nope"], ["logger=nope", "allowed", "csv", "tensorboard"]),
    (["logger.histograms=true"], ["logger.histograms", "allowed", "name"]),
    (["logger=tensorboard", "logger.histograms=often"], ["logger.histograms", "often", "bool"]),
    (["capture.gradcam_images=0"], ["capture.gradcam_images=0", ">= 1"]),
    (["+hooks=nope"], ["hooks=nope", "allowed", "clip"]),
    (["+hooks=grad_penalty", "hooks.grad_penalty.transforms.0.every=0"], ["every=0", ">= 1"]),
    (["+hooks=grad_penalty", "hooks.grad_penalty.transforms.0.weight=-1"], ["weight=-1", ">= 0"]),
    (["+hooks=grad_penalty", "trainer.compile=true"], ["trainer.compile=true", "double backward", "compile=false"]),
    (["+hooks=[grad_penalty,dp]"], ["hooks.grad_penalty", "whole loss", "examples", "input_grad_penalty"]),
    (["+hooks=[clip,nope]"], ["hooks=nope", "allowed", "clip", "min_zero"]),
    (["foo=[1"], ["foo=[1", "parse"]),
    (["optimizer._target_=torch.optim.Nope"], ["optimizer._target_", "torch.optim.Nope", "torch.optim.Adam"]),
    (["optimizer.lr=-1"], ["optimizer.lr=-1", ">= 0"]),
    (["optimizer.betas=[0.9,1.5]"], ["optimizer.betas", "1.5", "[0, 1)"]),
    (["trainer.hook_stage=nope"], ["trainer.hook_stage", "nope", "hook, fused"]),
    (["trainer.precision=fp8"], ["trainer.precision", "fp8", "fp32, bf16, fp16"]),
    (["trainer.nonfinite=ignore"], ["trainer.nonfinite", "ignore", "skip, raise, warn"]),
    (["trainer.strategy=foo"], ["trainer.strategy", "foo", "single, ddp"]),
    (["trainer.resume=/no/such.pt"], ["trainer.resume", "/no/such.pt", "auto"]),
    (["trainer.device=tpu"], ["trainer.device", "tpu", "cpu, cuda"]),
    (["data=fake", "data.image_size=0"], ["data.image_size=0", ">= 1"]),
    (["data=mnist", "data_dir=/etc/passwd"], ["data_dir", "/etc/passwd", "folder"]),
    (["data.n_test=7"], ["data.n_test=7", "multiple of 10"]),
    (["+hooks.r.params=*"], ["hooks.r.transforms", "clamp"]),
    ([RULE % "nope"], ["hooks.r.transforms", "'nope'", "allowed", "clamp"]),
    ([RULE % "{name: clamp, min: 1, max: 0}"], ["clamp", "min=1", "max=0", "min <= max"]),
    ([RULE % "{name: noise, std: -1}"], ["noise", "std=-1", ">= 0"]),
    ([RULE % "{name: clamp, lo: 1}"], ["clamp", "lo", "allowed: min, max"]),
    (
        ["+hooks.r={params: 'conv3.*', transforms: [zero]}"],
        ["hooks.r.params", "conv3.*", "close names", "conv2.weight"],
    ),
    (["+hooks.r={modules: conv9, transforms: [zero]}"], ["hooks.r.modules", "conv9", "close names", "conv2"]),
    (["+hooks.r={params: '*', transforms: [zero], stage: nope}"], ["hooks.r.stage", "nope", "hook, fused"]),
    (["+hooks.r={params: '*', prams: x, transforms: [zero]}"], ["hooks.r", "prams", "allowed", "params"]),
    (
        ["+hooks.r={params: '*', stage: hook, transforms: [{name: global_norm_clip, max_norm: 1}]}"],
        ["hooks.r.stage", "global_norm_clip", "'fused' only"],
    ),
    ([RULE % "{name: global_norm_clip, max_norm: 0}"], ["global_norm_clip", "max_norm=0", "> 0"]),
    (
        ["trainer.sync_check=true", "trainer.precision=fp16"],
        ["trainer.sync_check=true", "trainer.precision=fp16", "every step", "sync_check=false"],
    ),
    (
        ["trainer.sync_check=true", "trainer.nonfinite=skip"],
        ["trainer.sync_check=true", "trainer.nonfinite=skip", "every step", "nonfinite=warn"],
    ),
    (["trainer.epoch=3"], ["trainer.epoch", "did you mean trainer.epochs?", "allowed"]),
    (["+trainer.epoch=3"], ["trainer.epoch", "did you mean trainer.epochs?", "allowed"]),
    (["+hooks=clip", "hooks.clip.stag=fused"], ["hooks.clip.stag", "did you mean hooks.clip.stage?"]),
    (["hooks.mine.params=x"], ["hooks.mine", "to append to your config use +hooks.mine.params=x"]),
    (["+hooks=clip", "+hooks=zero"], ["+hooks", "+hooks=[clip,zero]"]),
    (["seed=-1"], ["seed=-1", ">= 0"]),
    (["trainer.device=cpu:1"], ["trainer.device", "cpu:1", "auto, cpu, cuda"]),
    ([f"seed={2**64}"], [f"seed={2**64}", "< 2**64"]),
    ([RULE % "{name: noise, std: inf}"], ["noise", "std=inf", "finite"]),
    (["trainer.resume=tests"], ["trainer.resume='tests'", "is a folder", "trainer.resume=auto hydra.run.dir=tests"]),
    (["trainer.hook_stage=per_sample"], ["trainer.hook_stage=per_sample", "allowed: hook, fused"]),
    (["data.sampling=random"], ["data.sampling", "random", "auto, shuffle, poisson"]),
    (["privacy.accountant=gdp"], ["privacy.accountant", "gdp", "rdp, prv"]),
    (["privacy.delta=2"], ["privacy.delta=2", "(0, 1)"]),
    (["+hooks=dp", "privacy.target_epsilon=nan"], ["privacy.target_epsilon=nan", "finite number > 0"]),
    (["+hooks=dp", "privacy.target_epsilon=inf"], ["privacy.target_epsilon=inf", "finite number > 0"]),
    (["+hooks=dp", "privacy.target_epsilon=-1"], ["privacy.target_epsilon=-1", "finite number > 0"]),
    (["+hooks=dp", "privacy.target_epsilon=1e308"], ["privacy.target_epsilon=1e+308", "bounds nothing"]),
    (["+hooks=dp", "privacy.target_epsilon=1e-9"], ["privacy.target_epsilon=1e-09", "unreachable"]),
    (["privacy.target_epsilon=3"], ["privacy.target_epsilon", "per_sample_clip", "+hooks=dp"]),
    (["+hooks=dp", "trainer.precision=fp16"], ["hooks.dp", "fp16", "fp32 or bf16"]),
    (["+hooks=dp", "model=resnet18"], ["BatchNorm", "model.norm=group"]),
    (["+hooks=[dp,clip]"], ["hooks.clip", "per_sample"]),
    # a rule of the wrong shape
    (["+hooks.r=5"], ["hooks.r=5", "not a rule", "mapping"]),
    (["+hooks.r=[a, b]"], ["hooks.r=['a', 'b']", "not a rule", "mapping"]),
    (["+hooks.r={params: '*', transforms: 5}"], ["hooks.r.transforms=5", "allowed", "a list of them"]),
    ([BAD_CONF, "+hooks=number_transforms"], ["hooks.number_transforms.transforms=5", "allowed"]),
    # noise_multiplier as YAML gives it: .nan, .inf, text; and as the command line does
    ([BAD_CONF, "+hooks=nan_noise"], ["hooks.nan_noise", "noise_multiplier=nan", "finite number"]),
    ([BAD_CONF, "+hooks=inf_noise"], ["hooks.inf_noise", "noise_multiplier=inf", "finite number"]),
    ([BAD_CONF, "+hooks=text_noise"], ["hooks.text_noise", "noise_multiplier='abc'", "number"]),
    (["+hooks=dp", "hooks.dp.transforms.0.noise_multiplier=inf"], ["hooks.dp", "noise_multiplier=inf", "finite"]),
    (["+hooks=dp", "hooks.dp.transforms.0.noise_multiplier=abc"], ["hooks.dp", "noise_multiplier='abc'", "number"]),
    # counts past a 64-bit integer, threads past the machine
    (["trainer.epochs=99999999999999999999"], ["trainer.epochs=99999999999999999999", "too large", "2**63 - 1"]),
    (["data.batch_size=99999999999999999999"], ["data.batch_size=99999999999999999999", "too large"]),
    (["trainer.threads=100000"], ["trainer.threads=100000", "CPUs", "allowed: 0"]),
    # values that can only diverge
    (["optimizer.lr=inf"], ["optimizer.lr=inf", "finite number >= 0"]),
    (["optimizer.lr=nan"], ["optimizer.lr=nan", "finite number >= 0"]),
    (["optimizer=sgd", "optimizer.momentum=inf"], ["optimizer.momentum=inf", "finite number >= 0"]),
    ([RULE % "{name: clamp, min: -1, max: inf}"], ["clamp", "max=inf", "finite number"]),
    ([RULE % "{name: clamp, bound: inf}"], ["clamp", "bound=inf", "finite number"]),
    ([RULE % "{name: scale, factor: inf}"], ["scale", "factor=inf", "finite number"]),
    ([RULE % "{name: scale, factor: -inf}"], ["scale", "factor=-inf", "finite number"]),
    ([RULE % "{name: norm_clip, max_norm: inf}"], ["norm_clip", "max_norm=inf", "finite number"]),
    (
        ["+hooks.r={params: '*', stage: fused, transforms: [{name: global_norm_clip, max_norm: inf}]}"],
        ["global_norm_clip", "max_norm=inf", "finite number"],
    ),
    (["+hooks=dp", "hooks.dp.transforms.0.max_norm=inf"], ["per_sample_clip", "max_norm=inf", "finite number"]),
    ([RULE % "{name: noise, std: nan}"], ["noise", "std=nan", "finite number"]),
    # optimizer.groups, checked before the model is built
    (["optimizer.groups={params: conv*}"], ["optimizer.groups={params: conv*}", "is a list", "=[{params: conv*}]"]),
    (["optimizer=muon", "optimizer.groups.0.optimizer.lr=abc"], ["optimizer.groups.0.optimizer.lr", "'abc'", "number"]),
    (
        ["optimizer.groups=[{params: conv*, optimizer: {_target_: torch.optim.LBFGS}}]"],
        ["optimizer.groups.0.optimizer._target_", "LBFGS", "closure", "allowed"],
    ),
]
if not torch.cuda.is_available():
    CASES.append((["trainer.device=cuda"], ["trainer.device", "cuda", "not available", "cpu"]))


def check(code: int, stderr: str, words: list[str]) -> None:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert code != 0, stderr
    assert "Traceback" not in stderr, stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    for w in words:
        assert w in lines[0], f"{w!r} not in {lines[0]!r}"


def test_table_has_enough_cases():
    assert len(CASES) >= 25


@pytest.mark.parametrize("half", [0, 1])
def test_every_bad_input_is_one_line(tmp_path, half):
    """Every other case through train.py's __main__, in one process (two halves: two workers)."""
    cases = CASES[half::2]
    lines = "".join(
        json.dumps([f"hydra.run.dir={tmp_path / str(i)}", f"data_dir={tmp_path / 'data'}", *BASE, *ov]) + "\n"
        for i, (ov, _) in enumerate(cases)
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("HYDRA_FULL_ERROR", None)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "support" / "cli_driver.py")],
        input=lines,
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    results = [json.loads(ln) for ln in proc.stdout.splitlines()]
    assert len(results) == len(cases), proc.stderr
    for (_, words), res in zip(cases, results):
        check(res["code"], res["stderr"], words)
    # nothing was trained: no run folder got a metrics file
    assert not list(tmp_path.glob("*/metrics.jsonl"))


@pytest.mark.parametrize("overrides,words", [CASES[0], CASES[34]])  # a compose error, a ValueError
def test_bad_input_as_its_own_process(tmp_path, overrides, words):
    proc = run_train(tmp_path, *BASE, *overrides, check=False, env={"HYDRA_FULL_ERROR": ""})
    assert proc.returncode == 2
    check(proc.returncode, proc.stderr, words)


def test_full_error_shows_the_traceback(tmp_path):
    proc = run_train(tmp_path, *BASE, "trainer.epochs=0", check=False, env={"HYDRA_FULL_ERROR": "1"})
    assert proc.returncode != 0
    assert "Traceback" in proc.stderr and "trainer.epochs=0 must be >= 1" in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("overrides,words", CASES, ids=[" ".join(ov) for ov, _ in CASES])
def test_bad_input_each_process(tmp_path, overrides, words):
    proc = run_train(tmp_path, *BASE, *overrides, check=False, env={"HYDRA_FULL_ERROR": ""})
    check(proc.returncode, proc.stderr, words)
