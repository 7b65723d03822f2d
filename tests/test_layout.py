"""The house's rules, checked: arrows point down, and the hook core needs no Hydra."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PKG = SRC / "gradmod"

# What each floor may import from gradmod: the floors below it, and the modules beside them.
BESIDE = {"gradmod.models", "gradmod.data", "gradmod.capture", "gradmod.weight_init"}
MAY_IMPORT = {
    "hooks": {"gradmod.hooks"},
    "reporting": {"gradmod.reporting", "gradmod.hooks"} | BESIDE,
    "training": {"gradmod.training", "gradmod.reporting", "gradmod.hooks"} | BESIDE,
    "integrations": {"gradmod.integrations", "gradmod.hooks", "gradmod.training"} | BESIDE,
}


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("floor", sorted(MAY_IMPORT))
def test_arrows_point_down(floor):
    bad = []
    for path in sorted((PKG / floor).glob("*.py")) if (PKG / floor).is_dir() else []:
        for name in _imports(path):
            top = name.split(".")[0]
            if top in ("hydra", "omegaconf"):
                bad.append(f"{path.name} imports {name}")
            elif top == "gradmod" and not any(name == a or name.startswith(a + ".") for a in MAY_IMPORT[floor]):
                bad.append(f"{path.name} imports {name}")
    assert not bad, f"gradmod/{floor}: " + "; ".join(bad)


def test_beside_modules_import_no_floor_above_them():
    for path in [PKG / f"{n}.py" for n in ("models", "data", "weight_init", "__init__")] + list((PKG / "capture").glob("*.py")):
        imported, name = _imports(path), path.name
        assert not any(i.split(".")[0] in ("hydra", "omegaconf") for i in imported), name
        assert not any(i.startswith(("gradmod.app", "gradmod.training", "gradmod.reporting")) for i in imported), name


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
    proc = subprocess.run([sys.executable, "-c", BLOCKED], capture_output=True, text=True,
                          env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]
