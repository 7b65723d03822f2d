"""Fixtures shared by the tests (plain helpers live in support/helpers.py, on the path)."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from helpers import KEEP, RESUMABLE, compose_config


def pytest_configure(config):
    """Under ``pytest -n N`` the workers share the cores: each worker, and the processes its
    tests start, use cores // N torch threads instead of all of them each."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        threads = max(1, (os.cpu_count() or 1) // workers)
        torch.set_num_threads(threads)
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))


@pytest.fixture(autouse=True)
def _transform_registry():
    """A transform a test registers lives for that test only (the help page lists the registry)."""
    from gradmod.hooks import registry

    saved = registry.entries().copy()  # every shipped transform registered before the copy
    yield
    registry._ENTRIES.clear()
    registry._ENTRIES.update(saved)


@pytest.fixture
def compose_cfg():
    """compose_cfg(*overrides) -> the real config (a fixture, for tests that take it as one)."""
    return compose_config


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """An uninterrupted RESUMABLE run (in this process): final parameters, summary, metrics.jsonl."""
    from gradmod.app.cli import run

    out = tmp_path_factory.mktemp("reference")
    summary = run(compose_config(*RESUMABLE), out)
    return torch.load(out / "model.pt"), summary, (out / "metrics.jsonl").read_text()


@pytest.fixture(scope="module")
def finished_runs(tmp_path_factory):
    """Two finished runs of different seeds (copied by each test before it changes them)."""
    from gradmod.app.cli import run

    runs = {}
    for name, seed in (("mine", 1234), ("other", 7)):
        out = tmp_path_factory.mktemp(name)
        run(compose_config(*KEEP, f"seed={seed}"), out)
        runs[name] = out
    return runs


@pytest.fixture
def mine(finished_runs, tmp_path):
    """A copy of the run with seed 1234, this test's to change."""
    out = tmp_path / "mine"
    shutil.copytree(finished_runs["mine"], out)
    return out


@pytest.fixture
def other(finished_runs, tmp_path):
    """A copy of the run with seed 7."""
    out = tmp_path / "other"
    shutil.copytree(finished_runs["other"], out)
    return out
