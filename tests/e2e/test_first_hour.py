"""A newcomer's first hour: the help page, plugins, own objects from the current folder,
hints that say what to type, the console plan, one-line errors, plots that say what they
show, a quiet console, the saved config of a ``_target_`` run, the install lines, the
README's example."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys

import pytest
import torch
import yaml
from helpers import FAST, ROOT, run_folders, run_train
from hydra.errors import HydraException

from gradmod import data as data_module
from gradmod.app import help as help_page
from gradmod.app.cli import describe
from gradmod.app.help import transform_lines
from gradmod.hooks import attach, registry, transforms
from gradmod.models import build_model
from gradmod.reporting import plots
from gradmod.reporting.plan import summarize_plan
from gradmod.run.config import SchedulerConfig
from gradmod.run.factories import build_scheduler

SPIRALS = {
    "__init__.py": "",
    "nets.py": "from torch import nn\n\n\nclass PointMLP(nn.Sequential):\n"
    "    def __init__(self, hidden=8):\n"
    "        super().__init__(nn.Linear(2, hidden), nn.ReLU(), nn.Linear(hidden, 2))\n",
    "data.py": "import torch\n\n\ndef make(n=48):\n    g = torch.Generator().manual_seed(0)\n"
    "    x = torch.randn(2 * n, 2, generator=g)\n    y = (x[:, 0] > 0).long()\n"
    "    return (x[:n], y[:n]), (x[n:], y[n:])\n",
    "opt.py": "import torch\n\n\nclass MySGD(torch.optim.SGD):\n    pass\n",
}


def test_own_objects_import_from_the_current_folder(tmp_path):
    """model, data and optimizer of the user's own package, with no plugins and no PYTHONPATH
    entry for it: the saved config names them, the log says examples and shows no_decay."""
    project = tmp_path / "project"
    (project / "spirals").mkdir(parents=True)
    for name, text in SPIRALS.items():
        (project / "spirals" / name).write_text(text)
    run = tmp_path / "run"
    cmd = [
        sys.executable,
        str(ROOT / "train.py"),
        f"hydra.run.dir={run}",
        "model._target_=spirals.nets.PointMLP",
        "+model.hidden=16",
        "data._target_=spirals.data.make",
        "optimizer=sgd",
        "optimizer._target_=spirals.opt.MySGD",
        "optimizer.weight_decay=0.1",
        "optimizer.no_decay=[*.bias]",
        "trainer.epochs=1",
        "trainer.device=cpu",
        "trainer.progress=false",
    ]
    proc = subprocess.run(
        cmd, cwd=project, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)}
    )
    assert proc.returncode == 0, proc.stderr
    saved = yaml.safe_load((run / ".hydra" / "config.yaml").read_text())
    assert saved["model"]["name"] == "spirals.nets.PointMLP" and saved["data"]["name"] == "spirals.data.make"
    assert saved["capture"]["gradcam_layer"] is None
    log = (run / "train.log").read_text()
    assert "on spirals.data.make (48 test examples)" in log
    assert (
        "optimizer groups (optimizer.no_decay): weight_decay=0.1: 0.weight, 2.weight; weight_decay=0: 0.bias, "
        "2.bias" in log
    )
    assert json.loads((run / "summary.json").read_text())["model"] == "spirals.nets.PointMLP"


def test_a_target_that_does_not_import_names_the_import_path(compose_cfg):
    from gradmod.app.config_store import validate

    with pytest.raises(
        ValueError,
        match=r"No module named 'nowhere_pkg'\); it is imported from the current "
        r"folder, PYTHONPATH or an installed package",
    ):
        validate(compose_cfg("optimizer._target_=nowhere_pkg.Opt"))


@pytest.mark.parametrize(
    "override, expected",
    [
        (
            "model.hidden=64",
            "unknown key model.hidden; allowed there: name, norm, _target_, args; "
            "to append to your config use +model.hidden=64",
        ),
        ("plugins=my_pkg.x", "plugins=my_pkg.x: plugins is a list; write plugins=[my_pkg.x]"),
    ],
)
def test_config_errors_say_what_to_type(compose_cfg, monkeypatch, override, expected):
    monkeypatch.setattr(sys, "argv", ["train.py", override])
    with pytest.raises(Exception) as e:
        compose_cfg(override)
    assert describe(e.value) == expected


def test_an_unknown_transform_points_at_plugins():
    with pytest.raises(ValueError, match=r"unknown transform 'soft_clip'; allowed: .*plugins=\[my_pkg.x\]"):
        attach(torch.nn.Linear(2, 2), {"s": {"params": "*", "transforms": ["soft_clip"]}})


def _lrs(cfg: SchedulerConfig, total: int) -> list[float]:
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    sched = build_scheduler(cfg, opt, total)
    out = []
    for _ in range(total):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_a_schedule_left_without_its_length_gets_the_runs():
    left_out = SchedulerConfig(_target_="gradmod.training.schedule.warmup_cosine", args={"warmup_steps": 2})
    given = SchedulerConfig(
        _target_="gradmod.training.schedule.warmup_cosine", args={"warmup_steps": 2, "total_steps": 10}
    )
    assert _lrs(left_out, 10) == _lrs(given, 10)
    cosine = _lrs(SchedulerConfig(_target_="torch.optim.lr_scheduler.CosineAnnealingLR"), 8)
    assert cosine == pytest.approx([0.5 * (1 + torch.cos(torch.tensor(torch.pi * t / 8)).item()) for t in range(8)])
    # LinearLR's total_iters has a number for its default: left as the scheduler's own choice.
    linear = _lrs(SchedulerConfig(_target_="torch.optim.lr_scheduler.LinearLR"), 8)
    assert linear[5:] == pytest.approx([1.0, 1.0, 1.0]) and linear[4] < 0.99  # total_iters=5, not the run's 8


def test_help_page_keeps_whole_sentences_in_columns_and_names_the_keys():
    hooks = "\n".join(help_page.hook_lines(ROOT / "gradmod" / "conf"))
    for f in (ROOT / "gradmod" / "conf" / "hooks").glob("*.yaml"):
        m = re.search(rf"^  {f.stem}\s+(.*(?:\n {{17}}\S.*)*)", hooks, re.M)
        text = " ".join(m.group(1).split())
        assert text == help_page._first_comment(f) and text.endswith((".", ")")), f.stem
    section = help_page.transform_lines()
    assert all(len(ln) <= help_page.WIDTH for ln in section)
    for ln in section:  # a name and its arguments, then the description at column 36; or a continuation
        assert re.match(r"^  \S.{32} \S|^ {36}\S|^  \S+\(.*[),]$", ln), ln  # a long signature goes on over lines
    zclip = " ".join(" ".join(section).split("zclip(")[1].split())
    assert zclip.endswith(".") and "After warmup_steps" not in zclip  # one whole sentence
    template = (ROOT / "gradmod" / "conf" / "hydra" / "help" / "gradmod.yaml").read_text()
    for key in (
        "model._target_=",
        "+model.width=64",
        "optimizer.no_decay",
        "scheduler=NAME",
        "loss._target_",
        "hooks.RULE.*",
        "${gradmod_help:docs}",
    ):
        assert key in template, key
    docs = help_page.doc_lines(ROOT / "docs")
    assert any(ln.startswith("  docs/guide/sweeps.md ") for ln in docs) and len(docs) >= len(
        list((ROOT / "docs").glob("*"))
    )


def test_columns_give_a_wide_name_a_line_of_its_own():
    assert help_page.columns("short", "Says a thing.", 10) == ["  short   Says a thing."]
    assert help_page.columns("a_very_long(name=1)", "Says a thing.", 10) == [
        "  a_very_long(name=1)",
        "          Says a thing.",
    ]
    assert (
        help_page.first_sentence("One (Smith et al. 2021): e.g. a thing\nover two lines. Two.")
        == "One (Smith et al. 2021): e.g. a thing over two lines."
    )


def _figure(monkeypatch, plot, rows, tmp_path):
    """The axes a plot function drew (its figure is caught before it is closed)."""
    caught = {}
    finish = plots._finish

    def keep(fig, axes, path):
        caught["axes"] = [(ax.get_title(), ax.get_ylabel(), [ln.get_label() for ln in ax.lines]) for ax in axes]
        return finish(fig, axes, path)

    monkeypatch.setattr(plots, "_finish", keep)
    plot(rows, tmp_path / "fig.png")
    assert (tmp_path / "fig.png").read_bytes()[:4] == b"\x89PNG"
    return caught["axes"]


def test_plots_tell_per_tensor_from_per_rule(monkeypatch, tmp_path):
    rule = {"norm": 3.0, "norm_max": 4.0, "clip_coef": 0.4, "clip_coef_min": 0.3, "frac_clipped": 1.0, "calls": 5}
    rows = [
        (
            s,
            {
                "gn/global_norm_clip": rule,
                "l1.weight/pre": {"norm": 2.0},
                "l1.weight/post": {"norm": 1.0, "frac_clipped": 0.25},
            },
        )
        for s in (5, 10)
    ]
    norms = _figure(monkeypatch, plots.plot_grad_norms, rows, tmp_path)
    assert norms[0][0].startswith("gradient norm per tensor") and "gn/global_norm_clip" not in norms[0][2]
    assert norms[1][0].startswith("total gradient norm per rule") and norms[1][2] == ["rule gn (global_norm_clip)"]
    fracs = _figure(monkeypatch, plots.plot_frac_clipped, rows, tmp_path)
    assert fracs[0][:2] == (
        "per tensor: fraction of gradient elements the transforms changed (clamp: clipped)",
        "fraction of elements changed",
    ) and fracs[0][2] == ["l1.weight"]
    assert fracs[1][1] == "fraction of steps clipped" and fracs[1][2] == ["rule gn (global_norm_clip)"]
    only_rule = [(5, {"gn/global_norm_clip": rule})]
    assert [a[1] for a in _figure(monkeypatch, plots.plot_frac_clipped, only_rule, tmp_path)] == [
        "fraction of steps clipped"
    ]


# torchvision's error when no mirror answers (its text, as torchvision 0.29 words it)
OFFLINE = (
    "Error downloading train-images-idx3-ubyte.gz:\n"
    "Tried https://ossci-datasets.s3.amazonaws.com/mnist/, got:\n<urlopen error [Errno -2] Name or service not known>\n"
    "Tried http://yann.lecun.com/exdb/mnist/, got:\n<urlopen error [Errno -2] Name or service not known>\n"
)


def test_the_offline_warning_is_one_short_line_its_cause_then_the_bare_fallback(monkeypatch, tmp_path, caplog):
    def offline(data_dir):
        raise RuntimeError(OFFLINE)

    monkeypatch.setattr(data_module, "_mnist", offline)
    with caplog.at_level(logging.WARNING, logger="gradmod.data"):
        first = data_module.load_data("mnist", data_dir=str(tmp_path / "data"))
        second = data_module.load_data("mnist", data_dir=str(tmp_path / "data"))
    assert first.name == second.name == "mnist_sample"
    assert [r.getMessage() for r in caplog.records] == [
        "MNIST unavailable (Name or service not known): using the bundled 5,000-digit sample (data=mnist_sample); "
        "data.fallback=false makes this an error",
        "MNIST unavailable: using the bundled 5,000-digit sample (data=mnist_sample)",
    ]
    kept = (tmp_path / "data" / data_module.FALLBACK_NOTE).read_text()  # the whole error, URLs and all
    assert "Tried https://ossci-datasets.s3.amazonaws.com/mnist/" in kept and "yann.lecun.com" in kept


def test_readme_offers_the_light_install_and_the_build_check():
    readme = (ROOT / "README.md").read_text()
    assert "pip install -e . --config-settings editable_mode=strict" in readme
    assert 'pip install -e ".[dev]" --config-settings editable_mode=strict' in readme
    assert 'python -c "import torch; print(torch.version.cuda)"' in readme
    for extra in ("tensorboard", "sweeps", "lightning", "mlflow", "dev"):
        assert f"| `{extra}` |" in readme, extra


def test_hooks_none_is_a_baseline_with_no_rules(compose_cfg):
    from gradmod.app.config_store import validate

    assert validate(compose_cfg("+hooks=none")).hooks == {}
    assert set(validate(compose_cfg("+hooks=[none,clip]")).hooks) == {"clip"}


# ---- the first runs: help, plugins, the plan, errors ----


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
        "  optimizer: adam, adamw, lamb, lars, muon, muon_split, sgd\n" in page
        and "  model: char_lm, dann, mnist_cnn, multi_lenet, resnet18, resnet50, tiny_gpt\n" in page
    )
    assert page.count("\n  gradmod ") >= 3  # the examples, as the console script
    run_dir, sweep_dir = run_folders()
    assert f"{run_dir}/ (a sweep: {sweep_dir}/N/" in page  # the folders the config makes, to the microsecond
    assert "labels by task" in page and "docs/guide/tasks.md" in page


def test_help_lists_a_newly_registered_transform():
    registry.register("halve_for_help", lambda factor=0.5: lambda g: g * factor)
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
        "import os\nimport gradmod\n\n"
        "def count():\n"
        "    def apply(grad):\n"
        "        with open(os.environ['CALLS'], 'a') as f:\n"
        "            f.write('x\\n')\n"
        "        return -grad\n"
        "    return apply\n\n"
        "gradmod.register('count', count)\n"
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
