"""The README's own install line, into a fresh virtual environment, and its API example run
from a folder that holds a ``gradmod/`` checkout (a clone's parent folder)."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT


def readme_install_lines() -> list[list[str]]:
    """The ``pip install`` lines of the README's set-up block, as arguments, without comments."""
    setup = re.search(r"## Set-up\n+```\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert setup, "README.md has no set-up block"
    return [shlex.split(x.split("#")[0]) for x in setup.group(1).splitlines() if x.startswith("pip install")]


def readme_install_line() -> list[str]:
    """The first (light) install line."""
    return readme_install_lines()[0]


def test_readme_installs_the_package_editable_and_strict():
    """The link tree of a strict editable install is what makes the checkout folder harmless;
    the light line installs the package alone, the other one the dev extra CI runs with."""
    lines = readme_install_lines()
    assert [args[:4] for args in lines] == [["pip", "install", "-e", "."], ["pip", "install", "-e", ".[dev]"]]
    assert all("editable_mode=strict" in args for args in lines)


@pytest.mark.slow
def test_readme_install_line_then_api_example_beside_a_checkout(tmp_path):
    checkout = tmp_path / "gradmod"  # a clone named after the package, as `git clone` makes it
    checkout.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, checkout / name)
    shutil.copytree(ROOT / "gradmod", checkout / "gradmod", ignore=shutil.ignore_patterns("__pycache__"))
    venv = tmp_path / "venv"
    # Offline and in seconds: pip, setuptools and the dependencies are the system's (a venv's own
    # bundled setuptools would be older than the one pyproject.toml builds with).
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)],
                   check=True, timeout=300)
    python = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing but the install finds gradmod
    install = [str(python), "-m", *readme_install_line(), "--no-deps", "--no-build-isolation"]
    proc = subprocess.run(install, cwd=checkout, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr

    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    script = tmp_path / "example.py"
    script.write_text("\n".join(blocks) + "\nprint('loaded from', gradmod.__file__)\n")
    proc = subprocess.run([str(python), str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "('conv2:output', ['log'])" in proc.stdout and "'flip'" in proc.stdout
    loaded = Path(proc.stdout.rsplit("loaded from ", 1)[1].strip())
    assert checkout in loaded.parents, f"gradmod came from {loaded}, not from the installed checkout"
