"""gradmod/conf/ restates the typed config's defaults where users read them: the two must agree."""

from __future__ import annotations

import dataclasses
import re
import typing

import pytest
import yaml
from helpers import CONF

from gradmod.app import help as help_page
from gradmod.hooks.rules.targets import STAGE_NAMES
from gradmod.run import config as C


def _yaml(name: str) -> dict:
    data = yaml.safe_load((CONF / name).read_text())
    data.pop("defaults", None)  # Hydra's composition list, not a value
    return data


def _defaults(cls: type) -> dict:
    """Every field's default, as the dataclass itself gives it."""
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def test_trainer_yaml_lists_every_trainer_key_with_its_default():
    """gradmod/conf/trainer/default.yaml is where the README sends users for every trainer key."""
    assert _yaml("trainer/default.yaml") == _defaults(C.TrainerConfig)


@pytest.mark.parametrize(
    "name, schema",
    [
        ("optimizer/sgd.yaml", C.SGDConfig),
        ("optimizer/adam.yaml", C.AdamConfig),
        ("logger/tensorboard.yaml", C.TensorBoardLoggerConfig),
        ("logger/csv.yaml", C.LoggerConfig),
        ("init/default.yaml", C.InitConfig),
        ("loss/auto.yaml", C.LossConfig),
    ],
)
def test_option_files_restate_their_schema_defaults(name, schema):
    data, defaults = _yaml(name), _defaults(schema)
    assert set(data) <= set(defaults), f"{name} sets keys its schema lacks"
    assert data == {k: defaults[k] for k in data}


def test_root_yaml_restates_the_root_defaults():
    data, defaults = _yaml("config.yaml"), _defaults(C.Config)
    assert {k: data[k] for k in ("seed", "data_dir", "hooks", "plugins")} == {
        k: defaults[k] for k in ("seed", "data_dir", "hooks", "plugins")
    }
    assert data["capture"] == _defaults(C.CaptureConfig)


def test_sgd_momentum_is_the_same_in_python_and_in_the_config(compose_cfg):
    """Python users building SGDConfig() get what ``optimizer=sgd`` gives."""
    assert C.SGDConfig().momentum == compose_cfg("optimizer=sgd").optimizer.momentum == 0.9


# Every group's option files against their schema: each value a file sets is the schema's
# default, each comment on a schema key is the field's one-line doc (its comment in
# gradmod/run/config.py); `name` and `_target_` comments describe the option itself.
OPTION_GROUPS = ["data", "init", "logger", "loss", "model", "optimizer", "scheduler", "trainer"]
ARGUMENT_GROUPS = {"loss": C.LossConfig, "scheduler": C.SchedulerConfig}  # other keys: the target's arguments
OWN = ("name", "_target_")


def _comments(path, node: str | None = None) -> dict[str, str]:
    """key -> its trailing comment (with the comment lines that continue it), at the top level
    of a YAML file or in one top-level node of it."""
    out: dict[str, str] = {}
    key, inside, indent = None, node is None, "" if node is None else "  "
    for line in path.read_text().splitlines():
        if node is not None and re.match(r"\w", line):
            inside, key = line.startswith(f"{node}:"), None
            continue
        m = re.match(rf"{indent}(\w+):.*?(?:\s#\s?(.*))?$", line) if inside else None
        if m and not line[len(indent) :].startswith(" "):
            key = m.group(1) if m.group(2) else None
            if key:
                out[key] = m.group(2).strip()
        elif inside and key and re.match(r"\s+#", line):
            out[key] += " " + line.strip().lstrip("#").strip()
        else:
            key = None
    return out


def _values(path) -> dict:
    """A YAML file as OmegaConf reads it (``1e-5`` a float, as Hydra sees it)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(path)) or {}


def _schema(group: str, path) -> type:
    """The dataclass a group option file builds on: its /schema/ default, else the root's field type."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    for entry in _values(path).get("defaults", []):
        if isinstance(entry, str) and entry.startswith("/schema/"):
            stored = ConfigStore.instance().load(entry[1:].split("@")[0] + ".yaml")
            return OmegaConf.get_type(stored.node)
    return ARGUMENT_GROUPS.get(group) or typing.get_type_hints(C.Config)[group]


OPTION_FILES = [(g, p) for g in OPTION_GROUPS for p in sorted((CONF / g).glob("*.yaml"))]


@pytest.mark.parametrize("group, path", OPTION_FILES, ids=[f"{g}/{p.name}" for g, p in OPTION_FILES])
def test_every_option_file_restates_its_schema_defaults_and_docs(group, path):
    schema = _schema(group, path)
    data = _values(path)
    data.pop("defaults", None)
    defaults, docs = _defaults(schema), help_page.field_docs(schema)
    fields = {f.name for f in dataclasses.fields(schema)}
    if group not in ARGUMENT_GROUPS:
        assert not sorted(set(data) - fields), f"{path.name} sets keys its schema {schema.__name__} lacks"
    set_here = {k: v for k, v in data.items() if k in fields and k not in OWN}
    assert set_here == {k: defaults[k] for k in set_here}, f"{path.name}: a value differs from {schema.__name__}'s"
    commented = {k: c for k, c in _comments(path).items() if k in fields and k not in OWN}
    assert commented == {k: docs.get(k) for k in commented}, f"{path.name}: a comment differs from the field's doc"


@pytest.mark.parametrize(
    "path, node, schema",
    [
        ("trainer/default.yaml", None, C.TrainerConfig),
        ("config.yaml", "privacy", C.PrivacyConfig),
        ("config.yaml", "capture", C.CaptureConfig),
    ],
)
def test_full_listings_give_every_key_its_doc(path, node, schema):
    """The files the README and --help send users to list every key with the field's doc."""
    docs = help_page.field_docs(schema)
    assert set(docs) == {f.name for f in dataclasses.fields(schema)}, f"{schema.__name__}: a field without a doc"
    assert _comments(CONF / path, node) == docs
    values = _values(CONF / path)
    assert (values[node] if node else {k: values[k] for k in docs}) == _defaults(schema)


def test_root_keys_give_their_doc():
    root = {k: c for k, c in _comments(CONF / "config.yaml").items() if k in ("seed", "data_dir", "hooks", "plugins")}
    assert root == {k: help_page.field_docs(C.Config)[k] for k in root} and len(root) == 4


@pytest.mark.parametrize("node", [*help_page.KEY_NODES, "rule"])
def test_help_lists_each_nodes_keys_from_its_schema(node):
    page = " ".join(help_page.key_list(node).split())
    schema = help_page.KEY_NODES.get(node, C.RuleConfig)
    names = [f.name for f in dataclasses.fields(schema) if not f.name.startswith("_") and f.name != "args"]
    assert page.startswith(", ".join(names))
    if node == "rule":
        assert page.endswith(f"stage ({' | '.join(STAGE_NAMES)})") and "per_sample" in page
