"""The README's own install line, into a fresh virtual environment, and its API example run
from a folder that holds a ``gradmod/`` checkout (a clone's parent folder)."""

from __future__ import annotations

import json
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
    subprocess.run(
        [sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True, timeout=300
    )
    python = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing but the install finds gradmod
    install = [str(python), "-m", *readme_install_line(), "--no-deps", "--no-build-isolation"]
    proc = subprocess.run(install, cwd=checkout, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr

    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    script = tmp_path / "example.py"
    script.write_text("\n".join(blocks) + "\nprint('loaded from', gradmod.__file__)\n")
    proc = subprocess.run(
        [str(python), str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert "('conv2:output', ['log'])" in proc.stdout and "'flip'" in proc.stdout
    loaded = Path(proc.stdout.rsplit("loaded from ", 1)[1].strip())
    assert checkout in loaded.parents, f"gradmod came from {loaded}, not from the installed checkout"


TINY = [
    "data=fake",
    "data.image_size=28",
    "data.channels=1",
    "data.train_size=40",
    "data.test_size=20",
    "data.batch_size=10",
    "trainer.epochs=1",
    "trainer.device=cpu",
    "trainer.progress=false",
]


def _venv(tmp_path: Path) -> Path:
    """A fresh venv that sees the system's packages (offline) but not this checkout."""
    venv = tmp_path / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True, timeout=300
    )
    return venv


@pytest.mark.slow
def test_wheel_ships_the_configs_and_composes_with_a_users_folder(tmp_path):
    """A regular (non-editable) wheel: the console script, shipped hook names and a user's own
    config folder outside the checkout, from a folder that holds no gradmod."""
    source = tmp_path / "source"  # a copy, so the build leaves nothing in the checkout
    top = {".git", "build", "gradmod.egg-info", "outputs", "multirun", "data", ".venv"}  # gradmod/conf/data stays
    shutil.copytree(
        ROOT, source, ignore=lambda d, names: [n for n in names if n == "__pycache__" or (Path(d) == ROOT and n in top)]
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"OMP_NUM_THREADS": "1"}
    wheels = tmp_path / "wheels"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(wheels),
            str(source),
        ],
        check=True,
        env=env,
        capture_output=True,
        timeout=600,
    )
    import gradmod as checkout

    assert [w.name for w in wheels.glob("*.whl")] == [f"gradmod-{checkout.__version__}-py3-none-any.whl"]
    venv = _venv(tmp_path)
    python, gradmod = venv / "bin" / "python", venv / "bin" / "gradmod"
    pip = [str(python), "-m", "pip"]
    subprocess.run(
        [*pip, "install", "-q", "--no-deps", "--ignore-installed", *wheels.glob("*.whl")],
        check=True,
        env=env,
        capture_output=True,
        timeout=600,
    )
    check = subprocess.run([*pip, "check"], env=env, capture_output=True, text=True, timeout=300)
    assert check.returncode == 0, check.stdout

    user = tmp_path / "user"  # the user's own folder: a rule file, nothing else
    (user / "my_conf" / "hooks").mkdir(parents=True)
    (user / "my_conf" / "hooks" / "bias_only.yaml").write_text(
        'frozen_bias:\n  params: "*.bias"\n  transforms: [zero]\n'
    )

    def gradmod_run(*args: str) -> subprocess.CompletedProcess:
        proc = subprocess.run([str(gradmod), *args], cwd=user, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc

    assert "clip " in gradmod_run("--help").stdout
    loaded = gradmod_run("--info", "config").stdout  # the search path: the installed package's conf/
    assert str(venv) in loaded and str(source) not in loaded
    gradmod_run("+hooks=clip", *TINY, f"hydra.run.dir={user / 'run_clip'}")
    plan = json.loads((user / "run_clip" / "hook_plan.json").read_text())
    assert {row["rule"] for row in plan} == {"clip"}
    gradmod_run(
        "--config-dir", str(user / "my_conf"), "+hooks=[clip,bias_only]", *TINY, f"hydra.run.dir={user / 'run_mine'}"
    )
    rules = {(row["tensor"], row["rule"]) for row in json.loads((user / "run_mine" / "hook_plan.json").read_text())}
    assert ("conv1.bias", "frozen_bias") in rules and ("conv1.weight", "clip") in rules
    gradmod_run(
        f"hydra.searchpath=[file://{user / 'my_conf'}]",
        "+hooks=bias_only",
        *TINY,
        f"hydra.run.dir={user / 'run_searchpath'}",
    )
    assert (user / "run_searchpath" / "summary.json").is_file()
