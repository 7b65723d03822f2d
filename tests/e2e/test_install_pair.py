"""torch and torchvision that do not work together are one line with the command that fixes
them, and the CPU install script checks the pair it leaves and falls back until one works."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
from helpers import ROOT, TINY_FAKE

from gradmod.install import fix_command, installed, matching_torchvision


def test_the_torchvision_of_a_torch_release():
    assert matching_torchvision("2.6.0") == "0.21.0"  # torch 2.6's release (torchvision's notes)
    assert matching_torchvision("2.13.0+cpu") == "0.28.0+cpu"
    assert matching_torchvision("1.13.1") is None
    here = matching_torchvision(installed("torch"))  # this environment's pair works (the suite runs)
    assert here.partition("+")[0] == installed("torchvision").partition("+")[0]
    assert fix_command("2.13.0+cpu") == (
        "pip install --force-reinstall --no-deps torchvision==0.28.0 --index-url https://download.pytorch.org/whl/cpu"
    )
    assert fix_command("2.13.0") == "pip install --force-reinstall --no-deps torchvision==0.28.0"


@pytest.mark.slow  # a process of its own that imports torch
def test_a_torchvision_built_for_another_torch_is_one_line(tmp_path):
    fake = tmp_path / "torchvision"
    fake.mkdir()
    (fake / "__init__.py").write_text('raise RuntimeError("operator torchvision::nms does not exist")\n')
    proc = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), f"hydra.run.dir={tmp_path / 'run'}", *TINY_FAKE],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": f"{tmp_path}:{ROOT}"},
        timeout=120,
    )
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
    line = proc.stderr.strip()
    assert line.startswith(f"error: torch {installed('torch')} and torchvision {installed('torchvision')} do not")
    assert "torchvision::nms does not exist" in line and line.endswith(fix_command(installed("torch")))


def _script():
    spec = importlib.util.spec_from_file_location("install_cpu_torch", ROOT / "scripts" / "install_cpu_torch.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_script_checks_the_pair_and_falls_back_until_it_works(capsys):
    script, ran = _script(), []

    def run(cmd):  # the first pair fails the check, the fixed one passes
        ran.append(cmd)
        checks = [c for c in ran if c[1] == "-c"]
        return 1 if cmd[1] == "-c" and len(checks) == 1 else 0

    assert script.main(run) == 0
    installs = [" ".join(c[2:]) for c in ran if c[1] == "-m"]
    assert installs == [script.FIRST, fix_command(installed("torch"))]
    assert all("torchvision.ops.nms" in c[2] for c in ran if c[1] == "-c")

    ran.clear()
    assert script.main(lambda cmd: ran.append(cmd) or 1) == 1  # nothing works: said, exit 1
    assert len([c for c in ran if c[1] == "-m"]) == 3
    assert "error: no working torch/torchvision pair" in capsys.readouterr().err
