"""The help page of ``python train.py --help`` (``conf/hydra/help/gradmod.yaml``).

The template's sections come from resolvers, so the page cannot drift from the code:
transforms and their arguments are read from the registry (a registered transform appears
by itself), hook configs and group options from the files in ``conf/``.
"""

from __future__ import annotations

import inspect
from pathlib import Path

from omegaconf import OmegaConf

from gradmod.hooks import transforms

HIDDEN_GROUPS = ("hooks", "hydra")  # hooks get their own section; hydra/ is Hydra's


def transform_lines() -> list[str]:
    """``name(arg=default, ...)  first docstring line`` for every registered transform."""
    lines = []
    for name in transforms.names():
        factory = transforms.factory(name)
        args = ", ".join(_argument(p) for p in inspect.signature(factory).parameters.values())
        doc = (inspect.getdoc(factory) or "").split("\n")[0].replace("``", "")
        lines.append(f"  {name + '(' + args + ')':<34} {doc}".rstrip())
    return lines


def _argument(p: inspect.Parameter) -> str:
    return p.name if p.default is inspect.Parameter.empty else f"{p.name}={p.default}"


def hook_lines(conf: Path) -> list[str]:
    """``NAME  first comment line`` for every ``conf/hooks/NAME.yaml``."""
    return [f"  {f.stem:<14} {_first_comment(f)}".rstrip() for f in sorted((conf / "hooks").glob("*.yaml"))]


def group_lines(conf: Path) -> list[str]:
    """``group: option, option`` for every pickable group (schemas live in code, not here)."""
    groups = sorted(d for d in conf.iterdir() if d.is_dir() and d.name not in HIDDEN_GROUPS)
    return [f"  {d.name}: {', '.join(sorted(f.stem for f in d.glob('*.yaml')))}" for d in groups]


def _first_comment(path: Path) -> str:
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            return line.lstrip("# ").strip()
    return ""


def register_help(conf: str | Path) -> None:
    """Register ``${gradmod_help:SECTION}`` for the help template; ``conf`` is the config folder."""
    conf = Path(conf)
    sections = {"transforms": transform_lines, "hooks": lambda: hook_lines(conf),
                "groups": lambda: group_lines(conf)}

    def section(name: str) -> str:
        if name not in sections:
            raise ValueError(f"gradmod_help:{name}: no such section; allowed: {', '.join(sections)}")
        return "\n".join(sections[name]())

    OmegaConf.register_new_resolver("gradmod_help", section, replace=True, use_cache=False)
