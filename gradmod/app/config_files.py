"""The user's own config files (``--config-dir``, ``hydra.searchpath``) checked before Hydra
reads them, each problem one line naming the file: YAML that does not parse, a tag that
would build a Python object (``!!python/...``), and aliases that expand to more nodes than a
config holds (an alias bomb, which OmegaConf would expand for minutes), and a file with
the name of a shipped one (``hooks/clip.yaml``), which Hydra would silently ignore. Only the files the
command line selects (``+hooks=[a,my_rules]``, ``model=mine``) are read, as YAML nodes:
nothing is constructed.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

# Far above any config (the shipped ones have a few hundred nodes), far below what hangs.
MAX_NODES = 100_000
# The plain-data tags of YAML 1.1 that PyYAML's safe loader builds; anything else is refused.
PLAIN_TAGS = {
    f"tag:yaml.org,2002:{t}"
    for t in ("str", "int", "float", "bool", "null", "map", "seq", "timestamp", "binary", "merge", "value")
}


class TooLarge(Exception):
    pass


def user_folders(argv: list[str]) -> list[Path]:
    """The config folders the command line adds: ``--config-dir DIR`` (``-cd``, ``=DIR``) and
    the ``file://`` entries of ``hydra.searchpath=[...]``."""
    found: list[str] = []
    for i, arg in enumerate(argv):
        if arg in ("--config-dir", "-cd") and i + 1 < len(argv):
            found.append(argv[i + 1])
        elif arg.startswith(("--config-dir=", "-cd=")):
            found.append(arg.split("=", 1)[1])
        elif arg.lstrip("+").startswith("hydra.searchpath="):
            found += re.findall(r"file://([^,\]\s'\"]+)", arg)
    return [Path(f).expanduser() for f in found]


def selected_files(argv: list[str], folders: list[Path]) -> list[Path]:
    """The YAML files in ``folders`` that the overrides ``[+]group=a`` or ``=[a,b]`` (or a
    sweep's ``=a,b``) select."""
    files = []
    for arg in argv:
        key, eq, value = arg.lstrip("+~").partition("=")
        if not eq or key.startswith("hydra"):
            continue
        for name in re.split(r"[\[\],\s]+", value):
            for folder in folders:
                path = folder / key.replace(".", "/") / f"{name}.yaml"
                if name and path.is_file():
                    files.append(path)
    return files


def check(argv: list[str], shipped: Path | None = None) -> None:
    """A ``ValueError`` naming the first selected user config file that is not plain YAML
    data, or that a different shipped file of the same name (in ``shipped``) hides."""
    for folder in user_folders(argv):
        for path in selected_files(argv, [folder]):
            check_file(path)
            if shipped is not None:
                _check_shadow(path, path.relative_to(folder), Path(shipped))


def _check_shadow(path: Path, name: Path, shipped: Path) -> None:
    """Hydra searches the shipped configs first: a user's file of a shipped name would be
    ignored, silently, so it is refused (unless it is a copy of the shipped one)."""
    theirs = shipped / name
    if theirs.is_file() and theirs.read_bytes() != path.read_bytes():
        group, stem = name.parent.as_posix(), name.stem
        raise ValueError(
            f"{path}: gradmod ships a config of this name ({group}/{stem}), which is found first, so yours "
            f"would be ignored; rename yours (e.g. {group}/my_{stem}.yaml) and select it by that name"
        )


def check_file(path: Path) -> None:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: cannot read ({getattr(e, 'strerror', None) or e})") from None
    try:
        nodes = list(yaml.compose_all(text, Loader=yaml.SafeLoader))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ValueError(f"{path}: not valid YAML{where}: {problem}") from None
    sizes: dict[int, int] = {}
    try:
        for node in nodes:
            _count(node, sizes, path)
    except TooLarge:
        raise ValueError(
            f"{path}: its aliases (*name) expand to more than {MAX_NODES:,} values; a config is plain "
            "data: write the values out"
        ) from None


def _count(node: yaml.Node, sizes: dict[int, int], path: Path) -> int:
    """The number of nodes ``node`` expands to (an alias counts its whole target again)."""
    if id(node) in sizes:
        return sizes[id(node)]
    if node.tag not in PLAIN_TAGS:
        line = node.start_mark.line + 1 if node.start_mark else "?"
        raise ValueError(
            f"{path}: line {line}: the tag {node.tag.replace('tag:yaml.org,2002:', '!!')} is not allowed; "
            "a config is plain data (strings, numbers, lists, mappings)"
        )
    children: list[yaml.Node] = []
    if isinstance(node, yaml.SequenceNode):
        children = node.value
    elif isinstance(node, yaml.MappingNode):
        children = [n for pair in node.value for n in pair]
    sizes[id(node)] = 0  # a node reached again while counting it: a cycle, counted once
    total = 1 + sum(_count(child, sizes, path) for child in children)
    if total > MAX_NODES:
        raise TooLarge
    sizes[id(node)] = total
    return total
