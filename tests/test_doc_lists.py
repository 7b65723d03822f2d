"""Where the docs list what exists (a config group's options, the transforms, the shipped hook
configs, a transform's arguments), the list is the one the code holds: a name added to
gradmod/conf/ or to the registry fails here until the docs name it, and each failure says
which name is missing from which doc."""

from __future__ import annotations

import inspect
import re

import yaml
from helpers import CONF, ROOT

from gradmod.hooks import registry
from gradmod.hooks.score_columns import COLUMNS, HEADERS, SCORES_FILE, SELF_INFLUENCE_FILE

GROUPS = ("model", "data", "optimizer", "loss", "scheduler", "init", "logger", "experiment", "workload")
USAGE, TRANSFORMS, SWEEPS, TASKS, MULTITASK = (
    "docs/guide/usage.md",
    "docs/reference/transforms.md",
    "docs/guide/sweeps.md",
    "docs/guide/tasks.md",
    "docs/guide/multitask.md",
)


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def read(doc: str) -> str:
    return (ROOT / doc).read_text()


def compare(doc: str, where: str, listed: list[str], group: str, existing: list[str] | None = None) -> list[str]:
    """What ``listed`` (a doc's list of ``group``'s options) lacks or names in vain, one line each."""
    existing = options(group) if existing is None else existing
    lacks = [f"{doc}: {where} does not list {group} {n!r}" for n in existing if n not in listed]
    vain = [f"{doc}: {where} names {group} {n!r}, which does not exist" for n in listed if n not in existing]
    return lacks + vain


def table_rows(doc: str, header: str) -> dict[str, str]:
    """The rows of the table under the header line starting ``header``: each name in a row's
    first cell (``| `mean`, `sum` |``) -> the row."""
    text = read(doc)
    start = text.index(header)
    rows = {}
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        rows.update((name, line) for name in re.findall(r"`(\w+)`", line.split("|")[1]))
    return rows


def test_usage_md_lists_every_option_of_each_config_group():
    text = " ".join(read(USAGE).split())
    problems = []
    for group in GROUPS:
        m = re.search(rf"`{group}=([\w|]+)`", text)
        if m is None:
            problems.append(f"{USAGE}: no `{group}=a|b|...` list of the {group} group's options")
            continue
        problems += compare(USAGE, f"`{group}=...`", m.group(1).split("|"), group)
    assert not problems, "\n".join(problems)


def test_every_no_such_option_example_lists_the_groups_options():
    problems, seen = [], 0
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        doc = path.relative_to(ROOT).as_posix()
        for m in re.finditer(r"error: (\w+)=\S+: no such option; allowed: ([\w, ]+)", path.read_text()):
            seen += 1
            problems += compare(doc, f"the example error of {m.group(1)}=", m.group(2).split(", "), m.group(1))
    assert seen and not problems, "\n".join(problems)


def test_sweeps_md_describes_every_experiment():
    rows = table_rows(SWEEPS, "| experiment | what it sets |")
    problems = compare(SWEEPS, "the experiments table", list(rows), "experiment")
    assert not problems, "\n".join(problems)


def _arguments(name: str) -> list[str]:
    return list(inspect.signature(registry.factory(name)).parameters)


def test_transforms_md_has_a_row_naming_every_argument_of_each_transform():
    """Element-wise, group, per_sample, sharpness and penalty transforms in transforms.md's table (one
    table: a row set apart by a blank line is not in it); per_loss methods in multitask.md's
    tables (their arguments there too)."""
    rows = table_rows(TRANSFORMS, "| name | arguments | gradient becomes |")
    shipped = [n for n in registry.names() if registry.factory(n).__module__.startswith("gradmod.")]
    problems = []
    here = [
        n for n in shipped if registry.entry(n).kind in ("elementwise", "group", "per_sample", "sharpness", "penalty")
    ]
    problems += compare(TRANSFORMS, "the transforms table", list(rows), "transform", here)
    methods = {**table_rows(MULTITASK, "| method | arguments (default) | what it does |")}
    methods.update(table_rows(MULTITASK, "| method | arguments (default) | weights |"))
    per_loss = [n for n in shipped if registry.entry(n).kind == "per_loss"]
    problems += compare(MULTITASK, "the methods' tables", list(methods), "per_loss method", per_loss)
    for doc, table in ((TRANSFORMS, rows), (MULTITASK, methods)):
        for name, row in table.items():
            if name not in registry.names():
                continue
            args = row.split("|")[2]
            problems += [
                f"{doc}: the row of `{name}` does not name its argument {a!r}"
                for a in _arguments(name)
                if not re.search(rf"`{a}\b", args)
            ]
    assert not problems, "\n".join(problems)


def _rules(name: str) -> dict:
    rules = yaml.safe_load((CONF / "hooks" / f"{name}.yaml").read_text()) or {}
    return {k: v for k, v in rules.items() if k != "defaults"}


def _per_loss(name: str) -> bool:
    """A hook config whose rules run at stage per_loss (a multi-task method's file)."""
    names = [t if isinstance(t, str) else t["name"] for r in _rules(name).values() for t in r.get("transforms") or []]
    return bool(names) and all(registry.entry(n).kind == "per_loss" for n in names)


def test_every_shipped_hook_config_is_described_as_it_is():
    """transforms.md's table gives each config's selection as the file does; the per_loss
    files are listed in tasks.md; the README names the others."""
    rows = table_rows(TRANSFORMS, "| config | rule | what it does |")
    hooks = options("hooks")
    others = [n for n in hooks if not _per_loss(n)]
    problems = compare(TRANSFORMS, "the shipped hook configs table", list(rows), "hook config", others)
    listed = re.search(r"The shipped per_loss hook\s+files \((.*?)\)\s+each", read(TASKS), re.S)
    per_loss = re.findall(r"`(?:\+hooks=)?(\w+)`", listed.group(1)) if listed else []
    problems += compare(TASKS, "the list of the shipped per_loss hook files", per_loss, "hook config", [
        n for n in hooks if _per_loss(n)
    ])  # fmt: skip
    readme = re.search(r"Shipped hook configs: (.*?); the transforms they use", read("README.md"), re.S)
    named = re.findall(r"`(\w+)`", readme.group(1)) if readme else []
    problems += [f"README.md: the shipped hook configs lack {n!r}" for n in others if n not in named]
    for name in others:
        for rule in _rules(name).values() if name in rows else []:
            for key in ("params", "modules", "exclude"):
                values = rule.get(key)
                for v in [values] if isinstance(values, str) else values or []:
                    if f'"{v}"' not in rows[name]:
                        problems.append(f"{TRANSFORMS}: the row of `{name}` does not give its {key} {v!r}")
    assert not problems, "\n".join(problems)


def test_usage_mds_example_error_is_the_one_a_run_prints():
    """A pattern matching nothing on the default model (mnist_cnn): the line as the run prints it."""
    import pytest

    from gradmod.hooks import attach
    from gradmod.models import build_model

    shown = re.search(r"`(error: hooks\.clip\.params: 'fc\*' [^`]*)`", " ".join(read(USAGE).split()))
    assert shown, f"{USAGE}: the example error of hooks.clip.params='fc*'"
    with pytest.raises(ValueError) as e:
        attach(build_model("mnist_cnn"), {"clip": {"params": "fc*", "transforms": ["zero"]}})
    assert shown.group(1) == f"error: {e.value}"


def test_the_score_files_columns_in_the_docs_are_the_sources():
    """scores.md shows scores.csv's header and lists self_influence.csv's columns, usage.md's
    table of a run's files lists scores.csv's, as ``gradmod.hooks.score_columns`` holds them."""
    scores, usage = read("docs/guide/scores.md"), read(USAGE)
    assert f"\n{HEADERS[SCORES_FILE]}\n" in scores
    assert f"- `{SELF_INFLUENCE_FILE}`: `{', '.join(COLUMNS[SELF_INFLUENCE_FILE])}`," in scores
    assert f"| `{SCORES_FILE}` | with a `scores` rule (`+hooks=scores`): `{', '.join(COLUMNS[SCORES_FILE])}`," in usage


def test_optimizers_mds_groups_example_builds_as_pasted():
    """The ``optimizer:`` example under "## Groups" passes the config check and builds on
    ``model=tiny_gpt``, as a user pastes it."""
    import gradmod
    from gradmod.models import TinyGPT
    from gradmod.optim.spec import check

    text = read("docs/guide/optimizers.md")
    block = re.search(r"## Groups\s+```yaml\n(.*?)```", text, re.S)
    assert block, "docs/guide/optimizers.md: no yaml example under ## Groups"
    spec = yaml.safe_load(block.group(1))["optimizer"]
    check(spec)
    opt = gradmod.optimizer(TinyGPT(65), spec)
    assert [type(o).__name__ for o in opt.optimizers] == ["AdamW", "Muon"]


def _summary_keys() -> list[str]:
    """The keys ``gradmod.run.runner._summary`` writes into a finished run's summary.json."""
    import ast

    tree = ast.parse((ROOT / "gradmod" / "run" / "runner.py").read_text())
    body = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_summary")
    made = next(n.value for n in ast.walk(body) if isinstance(n, ast.Return) and isinstance(n.value, ast.Dict))
    keys = [k.value for k in made.keys if isinstance(k, ast.Constant)]
    for spread in (v for k, v in zip(made.keys, made.values) if k is None):  # **({"privacy": ...} if ... else {})
        keys += [
            k.value for d in ast.walk(spread) if isinstance(d, ast.Dict) for k in d.keys if isinstance(k, ast.Constant)
        ]
    return keys


def test_usage_mds_summary_row_and_rule_keys_are_the_codes():
    """usage.md's table of a run's files names every key of summary.json, and its list of a
    rule's keys every key of ``RuleConfig``."""
    import dataclasses

    from gradmod.run.config import RuleConfig

    row = next(line for line in read(USAGE).splitlines() if line.startswith("| `summary.json` |"))
    keys = _summary_keys()
    assert "host_heap" in keys and "privacy" in keys
    problems = [f"{USAGE}: the summary.json row does not name {k!r}" for k in keys if f"`{k}`" not in row]
    listed = re.search(r"`hooks\.<rule>\.([\w|]+)`", read(USAGE))
    assert listed, f"{USAGE}: no `hooks.<rule>.a|b|...` list of a rule's keys"
    fields = [f.name for f in dataclasses.fields(RuleConfig)]
    problems += compare(USAGE, "`hooks.<rule>.`", listed.group(1).split("|"), "rule key", fields)
    assert not problems, "\n".join(problems)


def test_the_readmes_dev_row_names_every_package_of_the_dev_extra():
    """The README's table of extras names each package ``.[dev]`` pulls (the other extras it
    includes have rows of their own)."""
    import tomllib

    dev = tomllib.loads(read("pyproject.toml"))["project"]["optional-dependencies"]["dev"]
    names = [re.split(r"[\[<>=!~ ]", d, maxsplit=1)[0] for d in dev]
    row = next(line for line in read("README.md").splitlines() if line.startswith("| `dev` |"))
    pulls = row.split("|")[2]
    missing = [n for n in names if n != "gradmod" and not re.search(rf"\b{re.escape(n)}\b", pulls)]
    assert not missing, f"README.md: the `dev` row does not name {missing}"


def test_your_objects_mds_python_example_of_the_shipped_objects_runs():
    """The snippet under "## The shipped models and data in Python" runs as written: MNIST's
    inputs in [0, 1], ``tiny_gpt`` built and its loss taken."""
    text = read("docs/guide/your_objects.md")
    block = re.search(r"## The shipped models and data in Python.*?```python\n(.*?)```", text, re.S)
    assert block, "docs/guide/your_objects.md: no Python example of the shipped models and data"
    space: dict = {}
    exec(compile(block.group(1), "your_objects.md", "exec"), space)
    assert space["as_float"](space["train_x"]).max() == 1.0 and space["train_x"].dtype.is_floating_point is False
    assert type(space["gpt"]).__name__ == "TinyGPT" and space["loss"].ndim == 0
