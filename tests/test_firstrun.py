"""A new user's first runs: the help page, plugins, the console plan, one-line errors, the README's example."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from helpers import FAST, ROOT, run_train
from hydra.errors import HydraException

from gradmod.app.help import transform_lines
from gradmod.hooks import attach, registry, transforms
from gradmod.models import build_model
from gradmod.reporting.plan import summarize_plan


def _train(*args: str, cwd=ROOT) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args], cwd=cwd, capture_output=True, text=True, env=env, timeout=300
    )


def test_help_page_lists_hooks_transforms_real_groups_and_examples():
    proc = _train("--help")
    assert proc.returncode == 0, proc.stderr
    page = proc.stdout
    assert "powered by Hydra" not in page and "schema" not in page
    for name in transforms.names():
        assert f"  {name}(" in page, name
    assert "clamp(min=None, max=None, bound=None)" in page and "noise(std, decay=0.55)" in page
    for hook in (ROOT / "gradmod" / "conf" / "hooks").glob("*.yaml"):
        assert re.search(rf"^  {hook.stem}\s+\S", page, re.M), hook.stem
    assert (
        "  optimizer: adam, sgd\n" in page
        and "  model: char_lm, dann, mnist_cnn, multi_lenet, resnet18, resnet50, tiny_gpt\n" in page
    )
    assert page.count("\n  gradmod ") >= 3 and "outputs/DATE/TIME/" in page  # the examples, as the console script


def test_help_lists_a_newly_registered_transform():
    transforms.register("halve_for_help", lambda factor=0.5: lambda g: g * factor)
    try:
        assert any(line.strip().startswith("halve_for_help(factor=0.5)") for line in transform_lines())
    finally:
        registry.unregister("halve_for_help")


@pytest.mark.parametrize("override", ["optimizer=schema_sgd", "data=schema_fake", "logger=schema_tensorboard"])
def test_schemas_are_not_options(compose_cfg, override):
    with pytest.raises(HydraException):
        compose_cfg(override)


def test_sgd_option_keeps_its_momentum(compose_cfg):
    assert compose_cfg("optimizer=sgd").optimizer.momentum == 0.9


def test_plugins_register_transforms_for_train_py(tmp_path):
    pkg = tmp_path / "outside" / "my_pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    calls = tmp_path / "calls.txt"
    (pkg / "transforms.py").write_text(
        "import os\nfrom gradmod.hooks import transforms\n\n"
        "def count():\n"
        "    def apply(grad):\n"
        "        with open(os.environ['CALLS'], 'a') as f:\n"
        "            f.write('x\\n')\n"
        "        return -grad\n"
        "    return apply\n\n"
        "transforms.register('count', count)\n"
    )
    run_dir = tmp_path / "run"
    env = {"PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{tmp_path / 'outside'}", "CALLS": str(calls)}
    run_train(
        run_dir, *FAST, "plugins=[my_pkg.transforms]", '+hooks.f={params: "*.bias", transforms: [count]}', env=env
    )
    summary = json.loads((run_dir / "summary.json").read_text())
    plan = json.loads((run_dir / "hook_plan.json").read_text())
    assert [p["transforms"] for p in plan] == [["count"]] * len(plan) and len(plan) == 3  # the CNN's 3 biases
    assert len(calls.read_text().splitlines()) == summary["steps"] * len(plan)


def test_unknown_plugin_is_one_line(tmp_path):
    proc = run_train(tmp_path, *FAST, "plugins=[no_such_pkg_xyz]", check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert "plugins: cannot import 'no_such_pkg_xyz'" in proc.stderr


def test_console_plan_is_one_line_per_rule():
    model = build_model("resnet50", in_channels=3, num_classes=10, image_size=32)
    rules = {
        "clip": {"params": "*", "exclude": "*.bias", "transforms": [{"name": "clamp", "min": -0.01, "max": 0.01}]},
        "watch": {"modules": ["layer1", "layer2"], "transforms": ["log"]},
    }
    with attach(model, rules) as hooks:
        plan = hooks.describe()
        text = summarize_plan(plan, rules)
    n_clip = sum(1 for p in model.named_parameters() if not p[0].endswith(".bias"))
    assert text.splitlines()[1:] == [
        f"  clip: {n_clip} tensors matching '*' except '*.bias' -> clamp(min=-0.01, max=0.01)",
        "  watch: layer1:output, layer2:output -> log",
    ]
    assert len(plan) == n_clip + 2  # hook_plan.json keeps every tensor


def test_an_error_after_composing_prints_once(tmp_path):
    proc = run_train(tmp_path, *FAST, "+hooks=clip", "hooks.clip.params=nope*", check=False)
    assert proc.returncode == 2
    assert "nope*" not in proc.stdout
    assert len(proc.stderr.strip().splitlines()) == 1 and proc.stderr.startswith("error: hooks.clip.params")
    assert "nope*" in (tmp_path / "train.log").read_text()  # the run's log keeps it


def test_no_grad_stats_csv_without_log_rules(tmp_path):
    run_train(tmp_path, *FAST, "+hooks=clip")
    assert (tmp_path / "metrics.csv").exists() and not (tmp_path / "grad_stats.csv").exists()


def test_readme_api_example_runs_beside_a_gradmod_folder(tmp_path):
    """Run from a folder holding a `gradmod/` directory (a clone's parent): the package still loads."""
    (tmp_path / "gradmod").mkdir()
    (tmp_path / "gradmod" / "README.md").write_text("a checkout, not the package\n")
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    script = tmp_path / "example.py"
    script.write_text("\n".join(blocks))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert "('conv2:output', ['log'])" in proc.stdout and "'flip'" in proc.stdout
