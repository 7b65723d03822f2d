"""The house's rules, checked: arrows point down, and the hook core needs no Hydra."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "gradmod"

# What each floor may import from gradmod: the floors below it, and the modules beside them.
BESIDE = {
    "gradmod.models",
    "gradmod.data",
    "gradmod.labels",
    "gradmod.capture",
    "gradmod.weight_init",
    "gradmod.install",
}
MAY_IMPORT = {
    "hooks": {"gradmod.hooks"},
    "optim": {"gradmod.optim", "gradmod.hooks.rules.globs"},
    "reporting": {"gradmod.reporting", "gradmod.hooks"} | BESIDE,
    "training": {"gradmod.training", "gradmod.reporting", "gradmod.hooks"} | BESIDE,
    "integrations": {"gradmod.integrations", "gradmod.hooks", "gradmod.training"} | BESIDE,
    # the tools of tests and benchmarks (a bare epoch runs the Trainer): no floor imports them
    "testing": {"gradmod.testing", "gradmod.training", "gradmod.reporting", "gradmod.hooks"} | BESIDE,
    "run": {"gradmod.run", "gradmod.training", "gradmod.reporting", "gradmod.hooks", "gradmod.optim"} | BESIDE,
    "analysis": {"gradmod.analysis", "gradmod.run", "gradmod.training", "gradmod.reporting", "gradmod.hooks"} | BESIDE,
    "app": {"gradmod.app", "gradmod.analysis", "gradmod.run", "gradmod.training", "gradmod.reporting"}
    | {"gradmod.hooks", "gradmod.optim"}
    | BESIDE,
}
HYDRA_FLOORS = {"app"}  # the one floor (besides ./train.py) that imports hydra and omegaconf


def _imports(path: Path) -> set[str]:
    """Every module a file imports: ``from pkg import mod`` names both ``pkg`` and ``pkg.mod``
    (the graph below keeps the names that are modules); ``importlib.import_module("pkg.mod")``
    with a constant name is an import too."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
        elif _imported_by_name(node):
            names.add(node.args[0].value)
    return names


def _imported_by_name(node: ast.AST) -> bool:
    """``importlib.import_module("...")`` or ``import_module("...")`` with a constant string."""
    if not (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)):
        return False
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    return name == "import_module" and isinstance(node.args[0].value, str)


@pytest.mark.parametrize("floor", sorted(MAY_IMPORT))
def test_arrows_point_down(floor):
    bad = []
    for path in sorted((PKG / floor).rglob("*.py")) if (PKG / floor).is_dir() else []:
        for name in _imports(path):
            top = name.split(".")[0]
            if top in ("hydra", "omegaconf") and floor not in HYDRA_FLOORS:
                bad.append(f"{path.name} imports {name}")
            elif top == "gradmod" and not any(name == a or name.startswith(a + ".") for a in MAY_IMPORT[floor]):
                bad.append(f"{path.name} imports {name}")
    assert not bad, f"gradmod/{floor}: " + "; ".join(bad)


def test_beside_modules_import_no_floor_above_them():
    beside = [PKG / f"{n}.py" for n in ("models", "data", "labels", "weight_init", "__init__")]
    for path in beside + list((PKG / "capture").glob("*.py")):
        imported, name = _imports(path), path.name
        assert not any(i.split(".")[0] in ("hydra", "omegaconf") for i in imported), name
        floors = (
            "gradmod.app",
            "gradmod.analysis",
            "gradmod.run",
            "gradmod.training",
            "gradmod.reporting",
            "gradmod.integrations",
        )
        assert not any(i.startswith(floors) for i in imported), name


def _circles(root: Path, package: Path) -> list[str]:
    """The modules of ``package`` on an import circle: following its imports (module level,
    inside functions, and by constant name) returns to the start."""
    graph = {}
    for path in package.rglob("*.py"):
        mod = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        graph[mod] = {i for i in _imports(path) if i.startswith(f"{package.name}.") and i != mod}
    known = set(graph)

    def reach(start):
        seen, todo = set(), [start]
        while todo:  # "from pkg.hooks import transforms": the module pkg.hooks.transforms is the edge
            for nxt in (n for n in graph.get(todo.pop(), ()) if n in known):
                if nxt == start:
                    return True
                if nxt not in seen and not (start.startswith(nxt + ".") or nxt.startswith(start + ".")):
                    seen.add(nxt)
                    todo.append(nxt)
        return False

    return sorted(
        m
        for m in graph
        if "." in m
        and not m.endswith("__init__")
        and reach(m)
        and graph[m] - {p for p in known if m.startswith(p + ".")}
    )


def test_no_module_imports_itself_back():
    """No circle: following gradmod imports never returns to the start."""
    circles = _circles(ROOT, PKG)
    assert not circles, f"modules on an import circle: {circles}"


def test_a_circle_through_an_import_by_name_is_seen(tmp_path):
    """A table loaded by ``importlib.import_module`` that imports its loader back is a circle."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "registry.py").write_text(
        "import importlib\n\ndef entries():\n    return importlib.import_module('pkg.catalog').TABLE\n"
    )
    (pkg / "catalog.py").write_text("from pkg.registry import entries\n\nTABLE = {}\n")
    (pkg / "plain.py").write_text("import importlib\n\nNAME = 'pkg.catalog'\nimportlib.import_module(NAME)\n")
    assert _circles(tmp_path, pkg) == ["pkg.catalog", "pkg.registry"]
    (pkg / "catalog.py").write_text("TABLE = {'clamp': 'pkg.plain:clamp'}\n")  # a plain table: no circle
    assert _circles(tmp_path, pkg) == []


def test_names_are_not_repeated_across_floors():
    """One name, one meaning: no two modules share a file name, none shadows the standard library."""
    import collections

    names = collections.Counter(p.name for p in PKG.rglob("*.py") if p.name != "__init__.py")
    rooms = {
        "stats.py",
        "stage.py",
    }  # a stage's room: its own stage.py and stats.py (hooks/per_sample/, hooks/per_loss/)
    assert not [n for n, c in names.items() if c > 1 and n not in rooms], names
    assert not [n for n in names if n[:-3] in sys.stdlib_module_names]


BLOCKED = """
import sys

class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("hydra", "omegaconf"):
            raise ImportError(f"{name} is blocked")

sys.meta_path.insert(0, Block())
import torch
import gradmod
from torch import nn

model = nn.Sequential(nn.Linear(3, 2))
with gradmod.attach(model, {"clip": {"params": "*", "transforms": [{"name": "clamp", "min": -0.1, "max": 0.1}]}}):
    x = torch.ones(4, 3)
    (1e3 * model(x)).sum().backward()
assert model[0].weight.grad.abs().max() <= 0.1
assert not [m for m in sys.modules if m.split(".")[0] in ("hydra", "omegaconf")]
print("ok")
"""


def test_hook_core_works_without_hydra_or_omegaconf():
    proc = subprocess.run(
        [sys.executable, "-c", BLOCKED],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        timeout=120,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


def test_the_loops_over_stages_name_none():
    """HookSet, attach and the Trainer run every stage through the Stage protocol: no stage
    name appears in their code as a string or an attribute (docstrings aside)."""
    from gradmod.hooks import stages

    names = set(stages.names())
    for rel in ("hooks/hookset.py", "training/trainer.py", "training/stage_sync.py", "training/loop_hooks.py"):
        tree = ast.parse((PKG / rel).read_text())
        docs = {
            id(n.body[0].value)
            for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef)) and ast.get_docstring(n) is not None
        }
        named = sorted(
            {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and n.value in names and id(n) not in docs}
            | {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr in names}
        )
        assert not named, f"gradmod/{rel} names the stages {named}"


def test_every_stage_of_the_table_is_a_stage_class_in_its_own_folder():
    from gradmod.hooks import stages
    from gradmod.hooks.stage import Stage

    for facts in stages.STAGES:
        cls = stages.stage_class(facts.name)
        assert issubclass(cls, Stage) and cls.name == facts.name
        assert cls.__module__ == f"gradmod.hooks.{facts.name}.stage"
        assert (cls.accepts, cls.implied_by, cls.sees) == (facts.accepts, facts.implied_by, facts.sees)


def test_no_stage_room_names_another():
    """What a stage combines with are facts in its row of the stage table, checked in one
    place: a room names only its own stage (in code; messages and docstrings aside)."""
    from gradmod.hooks import stages

    bad = []
    for name in stages.names():
        for path in sorted((PKG / "hooks" / name).rglob("*.py")):
            tree = ast.parse(path.read_text())
            messages = {id(c) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for c in ast.walk(n)}
            others = {
                n.value
                for n in ast.walk(tree)
                if isinstance(n, ast.Constant)
                and n.value in stages.names()
                and n.value != name
                and id(n) not in messages
            }
            rooms = {i.split(".")[2] for i in _imports(path) if i.startswith("gradmod.hooks.") and i.count(".") >= 3}
            others |= (rooms & set(stages.names())) - {name}
            if others:
                bad.append(f"{path.relative_to(PKG)} names {sorted(others)}")
    assert not bad, "; ".join(bad)


# Where code outside the stage rooms may spell a stage's name, and why: the same word with
# another meaning, or the name as the user writes it.
NAMES_A_STAGE = {
    # the transform kinds (registry.KINDS), each named as the stage it implies
    ("gradmod/hooks/registry.py", "per_loss"),
    ("gradmod/hooks/registry.py", "per_sample"),
    ("gradmod/hooks/registry.py", "sharpness"),
    ("gradmod/hooks/registry.py", "penalty"),
    # torch optimizers' own fused= argument
    ("gradmod/optim/lamb.py", "fused"),
    ("gradmod/optim/spec.py", "fused"),
    ("gradmod/run/factories.py", "fused"),
    # the config's default trainer.hook_stage, as a user reads and overrides it
    ("gradmod/run/config.py", "hook"),
    # the layers' per-example forms (the per_sample room's), which influence reads for each example's gradient
    ("gradmod/analysis/example_grads.py", "per_sample"),
}


def _stage_names(path: Path, names: set[str]) -> list[tuple[int, str]]:
    """(line, stage) where ``path`` names a stage: a string constant equal to a stage name
    (docstrings aside), or an import from a stage's room (``gradmod.hooks.<stage>``)."""
    tree = ast.parse(path.read_text())
    docs = {
        id(n.body[0].value)
        for n in ast.walk(tree)
        if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and ast.get_docstring(n) is not None
    }
    found = {
        (n.lineno, n.value)
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and n.value in names and id(n) not in docs
    }
    for n in ast.walk(tree):
        modules = [a.name for a in n.names] if isinstance(n, ast.Import) else []
        if isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
            modules = [n.module, *(f"{n.module}.{a.name}" for a in n.names)]
        rooms = {m.split(".")[2] for m in modules if m.startswith("gradmod.hooks.")}
        found |= {(n.lineno, room) for room in rooms & names}
    return sorted(found)


def _outside_the_rooms(names: set[str]) -> list[Path]:
    """The package's modules but the stage rooms, the stage table and the catalog."""
    own = {PKG / "hooks" / "stages.py", PKG / "hooks" / "catalog.py"}
    rooms = [PKG / "hooks" / name for name in names]
    return [p for p in sorted(PKG.rglob("*.py")) if p not in own and not any(r in p.parents for r in rooms)]


def test_outside_the_rooms_no_code_names_a_stage():
    """Code outside the stage rooms asks the stage table's facts (which stage counts the
    examples, runs the backward, combines several losses), never a stage by name: no string
    constant equal to a stage name (docstrings aside), no import from a stage's room; the
    catalog, ``hooks/stages.py`` and ``NAMES_A_STAGE`` aside."""
    from gradmod.hooks import stages

    names = set(stages.names())
    bad = [
        f"{path.relative_to(ROOT)}:{line} names {name!r}"
        for path in _outside_the_rooms(names)
        for line, name in _stage_names(path, names)
        if (str(path.relative_to(ROOT)), name) not in NAMES_A_STAGE
    ]
    assert not bad, "; ".join(bad)


def test_a_stage_named_outside_the_rooms_is_seen(tmp_path):
    """The scan sees a stage's name as a constant and as a room's import, not in a docstring."""
    path = tmp_path / "x.py"
    path.write_text(
        '"""The per_sample stage."""\n\n'
        "from gradmod.hooks.per_sample import replace_batchnorm\n"
        "import gradmod.hooks.fused.trainability\n\n"
        "def f(t):\n"
        '    """fused"""\n'
        '    return t.stage == "per_loss" or t.kind == "module"\n'
    )
    assert _stage_names(path, {"per_sample", "fused", "per_loss"}) == [(3, "per_sample"), (4, "fused"), (8, "per_loss")]


MODULE_LINES, FUNCTION_LINES = 400, 50


def test_modules_and_functions_are_short():
    """A module reads in one sitting (at most 400 lines), a function on one screen (at most 50,
    its decorators and docstring included)."""
    long = []
    for path in sorted(PKG.rglob("*.py")):
        text = path.read_text()
        if len(text.splitlines()) > MODULE_LINES:
            long.append(f"{path.relative_to(ROOT)}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                if node.end_lineno - start + 1 > FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.name}: {node.end_lineno - start + 1} lines")
    assert not long, "; ".join(long)


FOLDER_MODULES = 16  # past this many, a folder wants a shelf (a room of its own), not a longer pile


def test_no_folder_is_a_pile():
    """Every package folder (gradmod's and the benchmarks') holds at most ``FOLDER_MODULES``
    modules besides its ``__init__``, so growth finds a shelf."""
    folders = {p.parent for p in [*PKG.rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py")]}
    counts = {f: len([p for p in f.glob("*.py") if p.name != "__init__.py"]) for f in folders}
    piles = [f"{f.relative_to(ROOT)}: {n} modules" for f, n in sorted(counts.items()) if n > FOLDER_MODULES]
    assert not piles, "; ".join(piles)


BENCHMARKS = ROOT / "benchmarks"


def _reads_sys_path(path: Path) -> bool:
    tree = ast.parse(path.read_text())
    return any(
        isinstance(n, ast.Attribute) and n.attr == "path" and isinstance(n.value, ast.Name) and n.value.id == "sys"
        for n in ast.walk(tree)
    )


def test_the_benchmarks_are_a_package_beside_the_library():
    """benchmarks/ (``python -m benchmarks``) imports its own modules as ``benchmarks.<module>``,
    and neither it nor scripts/ touches ``sys.path``; no module of the library imports a
    benchmark; a benchmark module reads in one sitting, and imports none back."""
    own = {p.stem for p in BENCHMARKS.glob("*.py")}
    bad = [f"{p.relative_to(ROOT)} reads sys.path" for p in sorted(BENCHMARKS.glob("*.py")) if _reads_sys_path(p)]
    bad += [
        f"{p.relative_to(ROOT)} reads sys.path" for p in sorted((ROOT / "scripts").glob("*.py")) if _reads_sys_path(p)
    ]
    for path in sorted(BENCHMARKS.glob("*.py")):
        bad += [f"{path.name} imports {name}" for name in _imports(path) if name.split(".")[0] in own]
        if len(path.read_text().splitlines()) > MODULE_LINES:
            bad.append(f"{path.name}: {len(path.read_text().splitlines())} lines")
    for path in sorted(PKG.rglob("*.py")):
        bad += [f"{path.relative_to(ROOT)} imports {n}" for n in _imports(path) if n.split(".")[0] == "benchmarks"]
    bad += [f"{m} is on an import circle" for m in _circles(ROOT, BENCHMARKS)]
    assert not bad, "; ".join(bad)


def test_the_hook_tests_mirror_the_stage_rooms():
    """Each stage's room has its tests in a folder of the same name under tests/hooks/, and
    no test of a room's own name lies outside it."""
    from gradmod.hooks import stages

    tests = ROOT / "tests" / "hooks"
    for name in stages.names():
        assert list((tests / name).glob("test_*.py")), f"tests/hooks/{name}/ holds no tests"
        assert not list(tests.glob(f"test_{name}*.py")), f"tests/hooks/test_{name}*.py belong in tests/hooks/{name}/"


def test_the_librarys_face():
    """``gradmod.__all__``: attach, HookSet, the rule loader, the optimizer by glob, the one
    register door and the bases an extension subclasses; each resolves, and a name of another module does not."""
    import gradmod

    face = ["Form", "GroupTransform", "HookSet", "Method", "attach", "load_rules", "optimizer", "register"]
    face.append("register_form")
    assert gradmod.__all__ == face
    assert all(getattr(gradmod, name) is not None for name in face)
    assert gradmod.register is gradmod.hooks.registry.register
    with pytest.raises(AttributeError):
        gradmod.grad_cam  # noqa: B018  (the article tools are gradmod.capture's)
