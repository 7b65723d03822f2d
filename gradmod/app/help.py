"""The help page of ``gradmod --help`` (``gradmod/conf/hydra/help/gradmod.yaml``).

The template's sections come from resolvers, so the page cannot drift from the code:
transforms and their arguments are read from the registry (a registered transform appears
by itself), hook configs and group options from the files in ``gradmod/conf/``.
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import re
import textwrap
import tokenize
from pathlib import Path

from gradmod.app.hydra_versions import register_resolver
from gradmod.hooks import stages
from gradmod.run import config as schemas

HIDDEN_GROUPS = ("hooks", "hydra")  # hooks get their own section; hydra/ is Hydra's


WIDTH = 100  # the page's width


def plugins_of(argv: list[str]) -> list[str]:
    """The modules a ``plugins=[a.b,c]`` override on the command line names."""
    given = [a.split("=", 1)[1] for a in argv if a.lstrip("+~").split("=", 1)[0] == "plugins" and "=" in a]
    return [m for m in re.split(r"[\[\],\s'\"]+", given[-1]) if m] if given else []


def transform_lines(plugins: list[str] = ()) -> list[str]:
    """``name(arg=default, ...)  first sentence of the docstring`` for every registered
    transform, the ``plugins``' too (imported first; one that fails says so in its line)."""
    from gradmod.hooks import transforms  # torch: loaded for the help page only
    from gradmod.run.setup import import_plugins

    lines = []
    for module in plugins:
        try:
            import_plugins([module])
        except ValueError as e:
            lines += [f"  ({e})"]
    for name in transforms.names():
        factory = transforms.factory(name)
        args = ", ".join(_argument(p) for p in inspect.signature(factory).parameters.values())
        signature = f"{name}({args})"
        if len(signature) + 2 > WIDTH:  # many arguments: the signature over lines of its own, then the sentence
            *head, signature = textwrap.wrap(signature, WIDTH - 2, subsequent_indent=" " * 34, break_on_hyphens=False)
            lines += [f"  {ln}" for ln in head]
        lines += columns(signature, first_sentence(inspect.getdoc(factory) or "").replace("``", ""))
    return lines


def _argument(p: inspect.Parameter) -> str:
    return p.name if p.default is inspect.Parameter.empty else f"{p.name}={p.default}"


def first_sentence(text: str) -> str:
    """The first sentence of a text's first paragraph, its lines joined (a description that
    runs over several comment or docstring lines is not cut at the first line's end)."""
    paragraph = " ".join(text.strip().split("\n\n")[0].split())
    m = re.search(r"(?<!e\.g)(?<!i\.e)(?<!etc)(?<!al)\.(\s|$)", paragraph)
    return paragraph[: m.start() + 1] if m else paragraph


def columns(left: str, right: str, column: int = 36) -> list[str]:
    """``left`` in a column, ``right`` wrapped beside it; a ``left`` too wide for the column
    gets a line of its own, so the descriptions stay aligned."""
    indent = " " * column
    wrapped = textwrap.wrap(right, WIDTH - column, break_on_hyphens=False) or [""]
    lines = [f"  {left}"] if len(left) + 3 > column else []
    first = wrapped[0] if lines else f"  {left:<{column - 3}} {wrapped[0]}"
    lines.append(first if not lines else indent + first)
    return [ln.rstrip() for ln in lines + [indent + w for w in wrapped[1:]]]


def field_docs(cls: type) -> dict[str, str]:
    """Each field's one-line doc: the comment on its line in the dataclass (a base class's
    for a field a subclass only re-defaults)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass) or klass.__module__ != cls.__module__:
            continue
        own = {f.name for f in dataclasses.fields(klass)}
        source = textwrap.dedent(inspect.getsource(klass))
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            m = re.match(r"    (\w+)\s*:", tok.line) if tok.type == tokenize.COMMENT else None
            if m and m.group(1) in own:
                docs[m.group(1)] = tok.string.lstrip("#").strip()
    return docs


# The nodes whose keys the help page lists from their schemas.
KEY_NODES = {
    "trainer": schemas.TrainerConfig,
    "capture": schemas.CaptureConfig,
    "privacy": schemas.PrivacyConfig,
    "data": schemas.DataConfig,
}


def key_list(node: str, indent: int = 14) -> str:
    """The keys of a config node, from its dataclass, wrapped for the Keys section."""
    if node == "rule":  # a hook rule: its keys, then the stages one may name
        words = [*(f.name for f in dataclasses.fields(schemas.RuleConfig))]
        words[-1] += f" ({' | '.join(stages.names())})"
    else:
        words = [
            _word(f) for f in dataclasses.fields(KEY_NODES[node]) if not f.name.startswith("_") and f.name != "args"
        ]
    return f"\n{' ' * indent}".join(textwrap.wrap(", ".join(words), WIDTH - indent, break_on_hyphens=False))


def _word(f: dataclasses.Field) -> str:
    """A key, or a node of keys with its own: ``keep.{fraction|which|...}``."""
    inner = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
    if not dataclasses.is_dataclass(inner):
        return f.name
    return f"{f.name}.{{{'|'.join(g.name for g in dataclasses.fields(inner))}}}"


def hook_lines(conf: Path) -> list[str]:
    """``NAME  first sentence of the file's comment`` for every ``gradmod/conf/hooks/NAME.yaml``."""
    return [ln for f in sorted((conf / "hooks").glob("*.yaml")) for ln in columns(f.stem, _first_comment(f), 17)]


def group_lines(conf: Path) -> list[str]:
    """``group: option, option`` for every pickable group (schemas live in code, not here)."""
    groups = sorted(d for d in conf.iterdir() if d.is_dir() and d.name not in HIDDEN_GROUPS)
    return [f"  {d.name}: {', '.join(sorted(f.stem for f in d.glob('*.yaml')))}" for d in groups]


def doc_lines(docs: Path | None) -> list[str]:
    """``docs/PATH.md  its title`` for every page of the docs folder, its guide, reference,
    design and benchmarks (none in an installed copy)."""
    if docs is None:
        return ["  (not installed with the package: the docs/ folder of the source repository)"]
    pages = sorted(docs.rglob("*.md"), key=lambda f: (f.parent != docs, f.relative_to(docs).as_posix()))
    return [ln for f in pages for ln in columns(f"docs/{f.relative_to(docs).as_posix()}", _title(f), 33)]


def checkout_docs(conf: Path) -> Path | None:
    """The docs folder of the source checkout that holds ``conf`` (``gradmod/conf/``); None for
    an installed copy, which has no docs (its site-packages may hold another project's ``docs/``)."""
    root = Path(conf).resolve().parents[1]
    return root / "docs" if (root / "pyproject.toml").is_file() else None


def _title(path: Path) -> str:
    first = path.read_text().lstrip().splitlines()[:1]
    return first[0].lstrip("# ").strip() if first else ""


def _first_comment(path: Path) -> str:
    """The first sentence of the comment block a config file starts with."""
    block = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        block.append(line.lstrip("#").strip())
    return first_sentence(" ".join(block))


def register_help(conf: str | Path, page: bool = True, argv: list[str] = ()) -> None:
    """Register ``${gradmod_help:SECTION}`` for the help template; ``conf`` is the config folder.
    Hydra resolves the template while composing every run's config: without ``page`` (no
    ``--help`` asked) the sections are left empty, so that no run loads torch for them.
    ``argv``: the command line, whose ``plugins=[...]`` add their transforms to the page."""
    conf = Path(conf)
    sections = {
        "transforms": lambda: transform_lines(plugins_of(list(argv))),
        "hooks": lambda: hook_lines(conf),
        "groups": lambda: group_lines(conf),
        "docs": lambda: doc_lines(checkout_docs(conf)),
        **{f"keys_{node}": (lambda node=node: [key_list(node)]) for node in [*KEY_NODES, "rule"]},
    }

    def section(name: str) -> str:
        if name not in sections:
            raise ValueError(f"gradmod_help:{name}: no such section; allowed: {', '.join(sections)}")
        return "\n".join(sections[name]()) if page else ""

    register_resolver("gradmod_help", section)
