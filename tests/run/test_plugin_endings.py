"""A plugin that ends the process at import (sys.exit, KeyboardInterrupt) fails the run in one
line with a failed ending's exit status, never 0 or another ending's."""

from __future__ import annotations

import json

import pytest
from helpers import TINY_FAKE, compose_config

from gradmod.app.config_store import validate
from gradmod.run import runner
from gradmod.run.folder import endings


@pytest.mark.parametrize(
    "body, said",
    [
        ("import sys\nsys.exit(0)\n", "called sys.exit(0)"),
        ("import sys\nsys.exit(3)\n", "called sys.exit(3)"),  # 3 would read as diverged
        ("raise KeyboardInterrupt\n", "raised KeyboardInterrupt"),
    ],
    ids=["exit0", "exit3", "keyboard_interrupt"],
)
def test_a_plugin_ending_the_process_at_import_is_a_failed_run(tmp_path, monkeypatch, body, said):
    name = f"ending_plugin_{abs(hash(body))}"
    (tmp_path / f"{name}.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "run"
    out.mkdir()  # as Hydra makes it
    cfg = compose_config(*TINY_FAKE, f"plugins=[{name}]")

    ending = runner.execute(lambda: validate(cfg), out)

    assert ending.status == "failed" and ending.exit_code == 2
    line = endings.message(ending.error)
    assert "\n" not in line and said in line and f"{name}.py:" in line
    assert json.loads((out / "summary.json").read_text())["status"] == "failed"
