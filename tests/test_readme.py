"""The README's Python example runs as written."""

import re

import torch
from helpers import ROOT, run_folders
from torch import nn

from gradmod.hooks import attach, registry


def test_readme_python_example_runs(capsys):
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert blocks, "the README has a Python example"
    try:
        for code in blocks:
            exec(compile(code, "README.md", "exec"), {})
        out = capsys.readouterr().out
        assert "('conv2:output', ['log'])" in out and "'any_negative'" in out and "flip" in out
        _plugin_group_transform_runs_fused()
    finally:
        registry.unregister("flip")
        registry.unregister("unit_norm")


def _plugin_group_transform_runs_fused():
    """The README's group transform: implied stage fused, the rule's gradients scaled to norm 1."""
    assert registry.entry("unit_norm").kind == "group"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    with attach(model, {"u": {"params": "*", "transforms": ["unit_norm"]}}) as hooks:
        assert {d["stage"] for d in hooks.describe()} == {"fused"}
        model(torch.randn(5, 4)).sum().backward()
        hooks.after_backward()
        total = torch.cat([p.grad.flatten() for p in model.parameters()]).norm()
        assert abs(total.item() - 1.0) < 1e-5
        assert hooks.read_stats()["u/unit_norm"]["calls"] == 1


def test_the_docs_name_the_run_folders_the_config_makes():
    """Hydra's folders carry the time to the microsecond (two runs in one second get a folder
    each); the README, usage.md and sweeps.md write them as the config makes them."""
    run_dir, sweep_dir = run_folders()
    assert (run_dir, sweep_dir) == ("outputs/YYYY-MM-DD/HH-MM-SS.ffffff", "multirun/YYYY-MM-DD/HH-MM-SS.ffffff")
    docs = {name: (ROOT / name).read_text() for name in ("README.md", "docs/guide/usage.md", "docs/guide/sweeps.md")}
    assert f"`{run_dir}/`" in docs["README.md"] and f"`{run_dir}/`" in docs["docs/guide/usage.md"]
    assert f"`{sweep_dir}/N/`" in docs["docs/guide/usage.md"] and f"`{sweep_dir}/N/`" in docs["docs/guide/sweeps.md"]
    for name, text in docs.items():
        assert "DATE/TIME" not in text, name


def test_the_readme_points_to_the_labels_by_task_contract():
    readme = (ROOT / "README.md").read_text()
    assert "labels by task" in readme and "[docs/guide/tasks.md](docs/guide/tasks.md)" in readme
    assert re.search(
        r"`pytest -n auto` \(the default suite: the last full run took \d+ to \d+ minutes on 2 \w+ cores\)", readme
    )


def test_the_readme_reads_in_one_sitting():
    """At most 150 lines: the detail lives in docs/guide/."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines"
