"""README, docs/ and the comments of gradmod/conf/ name only config keys, hook configs, files,
modules, links and command-line flags that exist."""

from __future__ import annotations

import importlib
import re

import pytest
from helpers import CONF, ROOT
from omegaconf import OmegaConf

DOCS = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]
CONF_FILES = sorted(CONF.rglob("*.yaml"))
TEXTS = DOCS + CONF_FILES
GROUP_KEY = re.compile(
    r"(?<![\w/.+])(trainer|data|optimizer|capture|logger|init|model|privacy)\.([a-z_]+)\b(?![(\w/])"
)  # +key: an added argument
HOOK_NAME = re.compile(r"(?:\+hooks=\[?|gradmod/conf/hooks/|hooks=)([a-z_]+(?:,[a-z_]+)*)")
CONF_PATH = re.compile(r"(?<![\w/])(gradmod/conf/[a-z_/.-]+\.yaml)")  # NAME.yaml is a placeholder
# A file of the repository: a path under one of its folders, or a top-level file.
FILE = re.compile(
    r"(?<![\w/.:-])((?:gradmod|tests|scripts|benchmarks|docs|examples|\.ci)/[\w./-]*\w|train\.py|pyproject\.toml|"
    r"CHANGELOG\.md|LICENSE)(?![\w(])"
)
MODULE = re.compile(r"(?<![\w./])(gradmod(?:\.\w+)+)")
FLAG = re.compile(r"(?:gradmod|train\.py) (?:-m )?(--[a-z-]+)")
HYDRA_FLAGS = {
    "--help",
    "--hydra-help",
    "--cfg",
    "--info",
    "--config-dir",
    "--config-path",
    "--config-name",
    "--multirun",
    "--run",
    "--resolve",
    "--package",
    "--shell-completion",
    "--version",
}
PLACEHOLDER = re.compile(
    r"\b(?:NAME|FILE|PATH|DATE|TIME|RULE)\b|<|\*|\.\.\."
)  # NAME, <run>, step-*.pt: not a real path
TYPO_EXAMPLES = {"trainer.epoch"}  # the docs' example of a typo and its one-line error
FILES = {"model.pt", "privacy.md"}  # file names that look like keys
RUN_FILES = {
    "train.log",
    "summary.json",
    "metrics.jsonl",
    "metrics.csv",
    "grad_stats.jsonl",
    "grad_stats.csv",
    "hook_plan.json",
    "model.pt",
}
LINK = re.compile(r"\]\((?!https?:|mailto:)([^)\s#]*)(?:#([\w-]+))?\)")


def _text(path) -> str:
    """The prose of a doc, or the comments of a config file; run folders' paths left out."""
    text = path.read_text()
    if path.suffix == ".yaml":
        text = "\n".join(m.group(1) for m in re.finditer(r"#(.*)$", text, re.M))
    return re.sub(r"multirun/\S+|outputs/\S+", "", text)


def _ids(paths):
    return [p.relative_to(ROOT).as_posix() for p in paths]


def _all_keys(compose_cfg) -> set[str]:
    keys = set()
    for overrides in ([], ["data=fake", "optimizer=sgd", "logger=tensorboard"], ["logger=mlflow"]):
        cfg = OmegaConf.to_container(compose_cfg(*overrides))
        for group, node in cfg.items():
            if isinstance(node, dict):
                keys.update(f"{group}.{k}" for k in node)
    return keys


@pytest.mark.parametrize("path", TEXTS, ids=_ids(TEXTS))
def test_config_keys_in_text_exist(compose_cfg, path):
    keys = _all_keys(compose_cfg)
    named = {f"{g}.{k}" for g, k in GROUP_KEY.findall(_text(path))}
    assert not sorted(named - keys - TYPO_EXAMPLES - FILES), f"{path.name} names keys the config does not have"


@pytest.mark.parametrize("path", TEXTS, ids=_ids(TEXTS))
def test_hook_configs_conf_files_and_doc_links_in_text_exist(path):
    text = _text(path)
    hooks = {n for group in HOOK_NAME.findall(text) for n in group.split(",")}
    missing = [n for n in hooks if not (CONF / "hooks" / f"{n}.yaml").exists() and n != "my_rules"]
    missing += [p for p in CONF_PATH.findall(text) if not (ROOT / p).exists() and "my_rules" not in p]
    assert not missing, f"{path.name} names what does not exist"


def _slugs(page) -> set[str]:
    """The anchors of a Markdown page's headings, as GitHub makes them."""
    heads = re.findall(r"^#+ (.*)$", re.sub(r"```.*?```", "", page.read_text(), flags=re.S), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


@pytest.mark.parametrize("path", DOCS, ids=_ids(DOCS))
def test_links_lead_to_files_and_headings_that_exist(path):
    broken = []
    for target, anchor in LINK.findall(_text(path)):
        page = (path.parent / target).resolve() if target else path
        if not page.exists():
            broken.append(target)
        elif anchor and page.suffix == ".md" and anchor not in _slugs(page):
            broken.append(f"{target}#{anchor}")
    assert not broken, f"{path.name} links to what does not exist"


@pytest.mark.parametrize("path", TEXTS, ids=_ids(TEXTS))
def test_files_modules_and_flags_named_exist(path):
    text = _text(path)
    missing = [f for f in FILE.findall(text) if not PLACEHOLDER.search(f) and not (ROOT / f.rstrip(".")).exists()]
    missing += [m for m in MODULE.findall(text) if not _resolves(m)]
    missing += [f for f in FLAG.findall(text) if f not in HYDRA_FLAGS]
    assert not missing, f"{path.name} names files, modules or flags that do not exist"


def _resolves(dotted: str) -> bool:
    """``gradmod.a.b``: a module, or an attribute of the longest module prefix."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False
