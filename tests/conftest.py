"""Shared test helpers: compose the real config, and run train.py as a user would."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

import gradmod.app.config  # noqa: F401  (registers the schemas the YAMLs build on)

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"

# A tiny, fast run on the bundled sample: the overrides most end-to-end tests start from.
FAST = ["data=mnist_sample", "trainer.epochs=1", "trainer.device=cpu", "trainer.progress=false"]


@pytest.fixture
def compose_cfg():
    """compose_cfg(*overrides) -> the real config, as train.py would see it."""

    def _compose(*overrides: str):
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            return compose(config_name="config", overrides=list(overrides))

    yield _compose
    GlobalHydra.instance().clear()


def run_train(tmp_path: Path, *overrides: str, multirun: bool = False, check: bool = True,
              env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``python train.py`` in a subprocess with its outputs under ``tmp_path``."""
    dir_key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    entry = "tests/kill_driver.py" if "GRADMOD_KILL_AT" in (env or {}) else "train.py"  # see kill_driver
    cmd = [sys.executable, str(ROOT / entry), *(["-m"] if multirun else []),
           f"{dir_key}={tmp_path}", f"data_dir={tmp_path / 'data'}", *overrides]
    full_env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), **(env or {})}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=full_env, timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"train.py failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc
