"""A config error is reported before torch loads: the command line composes and checks the
config with Hydra alone, so a typo costs about a second instead of torch's start-up."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from helpers import ROOT

# train.py with torch (and torchvision) made unimportable: a case that needs them fails loudly.
WITHOUT_TORCH = """
import runpy, sys

class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "torchvision"):
            raise ImportError(f"{name} was imported before the config was checked")

sys.meta_path.insert(0, Block())
sys.argv = ["train.py", *sys.argv[1:]]
runpy.run_path("train.py", run_name="__main__")
"""


@pytest.mark.parametrize(
    "override,words",
    [
        ("trainer.epoch=3", ["unknown key trainer.epoch", "did you mean trainer.epochs?"]),
        ("trainer.epochs=abc", ["trainer.epochs", "abc"]),
        ("model=nope", ["model=nope", "allowed", "mnist_cnn"]),
        ("+hooks=nope", ["hooks=nope", "allowed", "clip"]),
    ],
)
def test_a_config_error_needs_no_torch(tmp_path, override, words):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("HYDRA_FULL_ERROR", None)
    proc = subprocess.run(
        [sys.executable, "-c", WITHOUT_TORCH, f"hydra.run.dir={tmp_path}", override],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for w in words:
        assert w in lines[0]
