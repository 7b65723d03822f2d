"""README and docs/ name only config keys, hook configs, gradmod/conf/ files and docs that exist."""

from __future__ import annotations

import re

import pytest
from helpers import ROOT
from omegaconf import OmegaConf

TEXTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
GROUP_KEY = re.compile(r"(?<![\w/.+])(trainer|data|optimizer|capture|logger|init|model)\.([a-z_]+)\b(?![(\w/])")  # +key: an added argument
HOOK_NAME = re.compile(r"(?:\+hooks=\[?|gradmod/conf/hooks/|hooks=)([a-z_]+(?:,[a-z_]+)*)")
CONF_PATH = re.compile(r"(?<![\w/])(gradmod/conf/[a-z_/.-]+\.yaml)")  # NAME.yaml is a placeholder
TYPO_EXAMPLES = {"trainer.epoch"}  # the docs' example of a typo and its one-line error
FILES = {"model.pt"}
DOC_LINK = re.compile(r"\]\(((?:docs/)?[\w-]+\.md)(?:#[\w-]+)?\)")


def _text(path) -> str:
    return re.sub(r"multirun/\S+|outputs/\S+", "", path.read_text())


def _all_keys(compose_cfg) -> set[str]:
    keys = set()
    for overrides in ([], ["data=fake", "optimizer=sgd", "logger=tensorboard"]):
        cfg = OmegaConf.to_container(compose_cfg(*overrides))
        for group, node in cfg.items():
            if isinstance(node, dict):
                keys.update(f"{group}.{k}" for k in node)
    return keys


@pytest.mark.parametrize("path", TEXTS, ids=lambda p: p.name)
def test_config_keys_in_text_exist(compose_cfg, path):
    keys = _all_keys(compose_cfg)
    named = {f"{g}.{k}" for g, k in GROUP_KEY.findall(_text(path))}
    assert not sorted(named - keys - TYPO_EXAMPLES - FILES), f"{path.name} names keys the config does not have"


@pytest.mark.parametrize("path", TEXTS, ids=lambda p: p.name)
def test_hook_configs_conf_files_and_doc_links_in_text_exist(path):
    text = _text(path)
    hooks = {n for group in HOOK_NAME.findall(text) for n in group.split(",")}
    missing = [n for n in hooks if not (ROOT / "gradmod" / "conf" / "hooks" / f"{n}.yaml").exists() and n != "my_rules"]
    missing += [p for p in CONF_PATH.findall(text) if not (ROOT / p).exists() and "my_rules" not in p]
    base = ROOT if path.name == "README.md" else ROOT / "docs"
    missing += [link for link in DOC_LINK.findall(text) if not (base / link).exists()]
    assert not missing, f"{path.name} names what does not exist"
