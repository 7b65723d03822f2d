"""What a release needs besides the code: one version, the configs as package data, the
console script, the license and changelog, and CI's install checks."""

from __future__ import annotations

import fnmatch
import re

import pytest
from helpers import CONF, ROOT

import gradmod
from gradmod.app import cli

tomllib = pytest.importorskip("tomllib")  # Python 3.11's; 3.10 skips these checks
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_one_version_source():
    project = PYPROJECT["project"]
    assert "version" not in project and "version" in project["dynamic"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "gradmod.__version__"}
    major_minor = ".".join(gradmod.__version__.split(".")[:2])
    assert re.search(rf"^## {re.escape(major_minor)}\b", (ROOT / "CHANGELOG.md").read_text(), re.M)


def test_every_shipped_config_and_data_file_is_package_data():
    """A file under gradmod/ that is not Python ships only if package-data names it."""
    globs = PYPROJECT["tool"]["setuptools"]["package-data"]["gradmod"]
    configs = [p for p in CONF.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    assert configs and all(p.suffix == ".yaml" for p in configs), "gradmod/conf/ holds only YAML files"
    data = [
        p.relative_to(ROOT / "gradmod").as_posix()
        for p in (ROOT / "gradmod").rglob("*")
        if p.is_file() and p.suffix not in (".py", ".pyc")
    ]
    assert [p for p in data if not any(fnmatch.fnmatch(p, g) for g in globs)] == []


def test_console_script_runs_the_cli_on_the_shipped_configs():
    assert PYPROJECT["project"]["scripts"] == {"gradmod": "gradmod.app.cli:main"}
    assert cli.main.__defaults__ == (CONF,) and (CONF / "config.yaml").is_file()


def test_license_and_changelog():
    assert PYPROJECT["project"]["license"] == "MIT"
    assert (ROOT / "LICENSE").read_text().startswith("MIT License")


def test_ci_checks_the_install_then_lints_and_type_checks():
    lines = [ln.split("#")[0].strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()]
    lines = [ln for ln in lines if ln]
    for i, line in enumerate(lines):
        if "pip install" in line:
            assert lines[i + 1] == "python -m pip check", f"no pip check after {line!r}"
    assert "ruff check ." in lines and "mypy" in lines
