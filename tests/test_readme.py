"""The README's Python example runs as written."""

import re

from helpers import ROOT

from gradmod.hooks import transforms


def test_readme_python_example_runs(capsys):
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert blocks, "the README has a Python example"
    try:
        for code in blocks:
            exec(compile(code, "README.md", "exec"), {})
    finally:
        transforms._FACTORIES.pop("flip", None)
    out = capsys.readouterr().out
    assert "('conv2:output', ['log'])" in out and "'any_negative'" in out and "flip" in out
