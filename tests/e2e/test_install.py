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


def _readme_cpu_command() -> list[str]:
    """The README's command for the CPU wheels, as arguments."""
    found = re.search(r"`(python scripts/install_cpu_torch\.py)`", (ROOT / "README.md").read_text())
    assert found, "README.md names no CPU install command"
    return shlex.split(found.group(1))[1:]


def _pair(python: Path, env: dict) -> subprocess.CompletedProcess:
    from gradmod.install import CHECK

    return subprocess.run([str(python), "-c", CHECK], env=env, capture_output=True, text=True, timeout=300)


def _torch_dists(venv: Path) -> list[str]:
    """The torch and torchvision distributions installed in the venv itself."""
    return sorted(p.name for p in venv.glob("lib/python*/site-packages/torch*.dist-info"))


@pytest.mark.slow  # a fresh venv with its own pip; where the CPU index answers, a CPU torch download
def test_the_readmes_cpu_command_in_a_fresh_venv_leaves_a_working_cpu_pair_or_nothing(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [str(python), *_readme_cpu_command()], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800
    )
    if proc.returncode == 0:  # the CPU index answered: its pair, checked
        check = _pair(python, env)
        assert check.returncode == 0 and "cuda None" in check.stdout, check.stdout + check.stderr
        assert "+cpu" in check.stdout
    else:  # no CPU pair to be had (on this machine: a CPU torch and PyPI's torchvision, refused): nothing installed
        assert proc.returncode == 1 and _torch_dists(venv) == [], proc.stdout + proc.stderr
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "nothing changed" in errors[0] and "pip install -e ." in errors[0]


@pytest.mark.slow
def test_the_cpu_command_changes_nothing_where_the_pair_works(tmp_path):
    venv = _venv(tmp_path)  # sees this environment's working pair
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [str(venv / "bin" / "python"), *_readme_cpu_command()], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0 and proc.stdout.splitlines()[-1] == "nothing changed", proc.stdout + proc.stderr
    assert _torch_dists(venv) == []


@pytest.mark.slow
@pytest.mark.install  # installs a torch wheel into a venv, then repairs it with a release of several GB
def test_a_broken_pair_is_repaired_by_the_printed_command_or_left_as_it_was(tmp_path):
    """The pair seen broken: a CPU torch beside PyPI's torchvision of its release. gradmod's
    line names ``python -m gradmod.install``; run, it leaves a working pair or the one it found."""
    venv = _venv(tmp_path)
    python = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    mixed = ["torch==2.13.0+cpu", "torchvision==0.28.0"]
    setup = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-deps", *mixed], env=env, capture_output=True, text=True
    )
    if setup.returncode != 0:
        pytest.skip(f"{' and '.join(mixed)} are not on this machine's indexes: {setup.stderr.strip()[-200:]}")
    assert _pair(python, env).returncode != 0  # broken, as seen
    before = _torch_dists(venv)
    from gradmod.install import REPAIR

    proc = subprocess.run(
        [str(python), *shlex.split(REPAIR)[1:]],
        cwd=tmp_path,
        env={**env, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if proc.returncode == 0:
        pair = _pair(python, env)
        assert pair.returncode == 0, proc.stdout + proc.stderr
        assert "ResolutionImpossible" not in proc.stdout + proc.stderr  # pip's planning words: only where it fails
        said = "this changes torch's build: torch 2.13.0+cpu (CPU only) -> torch "
        assert said in proc.stdout or "+cpu" in pair.stdout, proc.stdout  # another build is said before it installs
    else:
        assert _torch_dists(venv) == before, proc.stdout + proc.stderr
