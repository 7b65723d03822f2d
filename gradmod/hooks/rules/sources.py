"""Hook config files as rules: a path, the name of a shipped file (``"clip"``), or a list
of these merged by rule name.

The shipped files are package data, ``gradmod/conf/hooks/`` (Hydra's ``+hooks=NAME``
group), found from this module's real location, so a name works from any folder with a
regular or an editable install; ``shipped_names()`` lists them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

# Resolved: a strict editable install links each file from the checkout.
SHIPPED = Path(__file__).resolve().parents[2] / "conf" / "hooks"  # gradmod/conf/hooks


def shipped_names() -> list[str]:
    return sorted(p.stem for p in SHIPPED.glob("*.yaml"))


def hook_file(spec: str | Path) -> Path:
    """The file ``spec`` names: an existing path, else a shipped file's name (``clip``)."""
    path = Path(spec)
    if path.is_file():
        return path
    name = str(spec).removesuffix(".yaml")
    if "/" not in name and "\\" not in name and (SHIPPED / f"{name}.yaml").is_file():
        return SHIPPED / f"{name}.yaml"
    names = shipped_names()
    known = f"shipped hook files: {', '.join(names)}" if names else f"no shipped hook files found in {SHIPPED}"
    raise ValueError(f"hook file {str(spec)!r} not found (no such path, and not a shipped name); {known}")


def read_rule_file(spec: str | Path) -> dict[str, Any]:
    """One file's rules. Its ``defaults`` list is Hydra's composition (it gives each rule
    every key), not a rule."""
    import yaml  # only for files: the core needs no YAML otherwise

    path = hook_file(spec)
    rules = yaml.safe_load(path.read_text()) or {}
    if not isinstance(rules, Mapping):
        raise ValueError(
            f"hook file {str(path)!r} must hold a mapping of rule name to rule, got {type(rules).__name__}"
        )
    return {k: v for k, v in rules.items() if k != "defaults"}


def merge_rules(parts: list[tuple[str, Mapping[str, Any]]]) -> dict[str, Any]:
    """(source, rules) pairs merged by rule name; a name in two sources is an error."""
    out: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for source, rules in parts:
        for name, rule in rules.items():
            if name in origin:
                raise ValueError(
                    f"rule {name!r} is in both {origin[name]} and {source}; rules merge by name, so rename one of them"
                )
            out[name], origin[name] = rule, source
    return out


def read_rules(spec: Any) -> dict[str, Any]:
    """Rules from a file (path or shipped name) or a list of files and mappings."""
    if isinstance(spec, (str, Path)):
        return read_rule_file(spec)
    parts = []
    for i, item in enumerate(spec):
        if isinstance(item, (str, Path)):
            parts.append((repr(str(item)), read_rule_file(item)))
        elif isinstance(item, Mapping):
            parts.append((f"mapping #{i + 1}", item))
        else:
            raise ValueError(
                f"rules: item #{i + 1} is a {type(item).__name__}; allowed: a mapping, "
                "a hook file path or a shipped name"
            )
    return merge_rules(parts)
