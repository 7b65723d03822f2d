"""The config's value checks are torch-free, and the names they allow are the registries' own."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import ROOT

from gradmod.run import checks
from gradmod.run.config import Config, ModelConfig, OptimizerConfig, TrainerConfig


def test_restated_names_are_the_registries():
    from gradmod import data, models, weight_init
    from gradmod.hooks.rules.targets import DEFAULT_STAGES
    from gradmod.training import loader, nonfinite, precision
    from gradmod.training.distributed import strategy as distributed

    assert checks.MODELS == tuple(models.MODELS) and checks.NORMS == tuple(models.NORMS)
    assert checks.DATASETS == tuple(data.DATASETS)
    assert checks.INITS == tuple(weight_init.INITS)
    assert checks.HOOK_STAGES == tuple(DEFAULT_STAGES)
    assert checks.PRECISIONS == tuple(precision.DTYPES)
    assert checks.STRATEGIES == tuple(distributed.STRATEGIES)
    assert checks.NONFINITE == tuple(nonfinite.POLICIES)
    assert checks.PLACEMENTS == tuple(loader.PLACEMENTS)


def test_the_schemas_and_their_checks_load_without_torch():
    code = (
        "import sys; import gradmod.app.config_store; import gradmod.run.config; "
        "heavy = [m for m in ('torch', 'torchvision') if m in sys.modules]; print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_the_app_starts_no_native_thread_so_a_sweep_job_can_fork():
    """A thread started by an import (numpy's OpenBLAS pool) reads as a torch pool to the
    sweep's fork check, and every job would run unisolated in the launcher's process."""
    code = (
        "import os; import gradmod.app.cli; from gradmod.app import isolated; "
        "print(len(os.listdir('/proc/self/task'))); "
        "isolated.preload(gradmod.app.cli.TRAINING); print(isolated.fork_is_safe())"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["1", "True"], out.stdout + out.stderr


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_an_optimizer_value_that_can_only_diverge_is_refused(value):
    with pytest.raises(ValueError, match=r"optimizer.lr=.* must be a finite number >= 0"):
        OptimizerConfig(_target_="torch.optim.SGD", lr=value)


def test_counts_fit_a_64_bit_integer():
    TrainerConfig(epochs=checks.LARGEST_INT)
    with pytest.raises(ValueError, match=r"trainer.epochs=9223372036854775808 is too large"):
        TrainerConfig(epochs=checks.LARGEST_INT + 1)


def test_threads_at_most_the_cpus(monkeypatch):
    monkeypatch.setattr(checks.os, "cpu_count", lambda: 4)
    TrainerConfig(threads=4)
    with pytest.raises(ValueError, match=r"trainer.threads=5 is more than this machine's 4 CPUs; allowed: 0"):
        TrainerConfig(threads=5)


@pytest.mark.parametrize(
    "rule,words",
    [
        (5, "hooks.r=5 is not a rule"),
        (["a", "b"], "hooks.r=\\['a', 'b'\\] is not a rule"),
        ({"params": "*", "transforms": 5}, "hooks.r.transforms=5 is not allowed"),
        ({"params": "*", "transforms": ["zero", 3]}, "hooks.r.transforms=\\['zero', 3\\] is not allowed"),
    ],
)
def test_a_rule_of_the_wrong_shape_is_refused(rule, words):
    with pytest.raises(ValueError, match=words):
        Config(model=ModelConfig("mnist_cnn"), hooks={"r": rule})


def test_rules_of_the_right_shape_pass():
    for transforms in ("zero", {"name": "clamp", "bound": 1}, ["zero", {"name": "scale", "factor": 2}], None):
        Config(model=ModelConfig("mnist_cnn"), hooks={"r": {"params": "*", "transforms": transforms}})


@pytest.mark.parametrize("given", ["outputs/x", "outputs/x/", "outputs/x/checkpoints", "outputs/x/checkpoints/"])
def test_a_run_folder_or_its_checkpoints_given_as_the_resume_names_the_run_folder(tmp_path, monkeypatch, given):
    """The checkpoints folder itself was taken for the run folder (``.../checkpoints//checkpoints``)."""
    (tmp_path / "outputs" / "x" / "checkpoints").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as e:
        checks._resume(given)
    assert str(e.value).endswith(
        "(outputs/x/checkpoints/step-*.pt), or resume the run it holds with trainer.resume=auto hydra.run.dir=outputs/x"
    )
