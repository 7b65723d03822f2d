"""Config schemas: Hydra structured configs that make bad input fail before any work.

``Config`` is the base of ``gradmod/conf/config.yaml`` (``defaults: [base_config, ...]``), so a
typo (``trainer.epoch=3``) or a wrong type (``trainer.epochs=abc``) fails while Hydra
composes. ``validate(cfg)`` then builds the dataclasses (``OmegaConf.to_object``), whose
``__post_init__`` checks values, and checks what a schema cannot: keys added with ``+``,
the optimizer's arguments, the data folder. Every failure is a one-line ``ValueError``.

Data, optimizer and logger options differ in their keys, so each option file extends its schema
(``defaults: [/schema/data/fake@_here_]``); the schemas are subclasses of the root's field type,
kept in the ``schema/`` group so that they are never offered as options (``optimizer=...``).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import sys
from pathlib import Path

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from gradmod.app import launchers
from gradmod.run.config import (
    AdamConfig,
    AdamWConfig,
    CharTextDataConfig,
    Config,
    DataConfig,
    FakeDataConfig,
    MLflowLoggerConfig,
    MuonConfig,
    RuleConfig,
    SGDConfig,
    TensorBoardLoggerConfig,
)
from gradmod.run.optimizer_presets import LambConfig, LarsConfig, MuonSplitConfig


def register() -> None:
    """Put the schemas in Hydra's ConfigStore (done on import; harmless to repeat)."""
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    cs.store(group="schema/data", name="mnist", node=DataConfig)
    cs.store(group="schema/data", name="fake", node=FakeDataConfig)
    cs.store(group="schema/data", name="char_text", node=CharTextDataConfig)
    cs.store(group="schema/optimizer", name="adam", node=AdamConfig)
    cs.store(group="schema/optimizer", name="sgd", node=SGDConfig)
    cs.store(group="schema/optimizer", name="adamw", node=AdamWConfig)
    cs.store(group="schema/optimizer", name="muon", node=MuonConfig)
    cs.store(group="schema/optimizer", name="lars", node=LarsConfig)
    cs.store(group="schema/optimizer", name="muon_split", node=MuonSplitConfig)
    cs.store(group="schema/optimizer", name="lamb", node=LambConfig)
    cs.store(group="schema/logger", name="tensorboard", node=TensorBoardLoggerConfig)
    cs.store(group="schema/logger", name="mlflow", node=MLflowLoggerConfig)
    cs.store(group="schema", name="rule", node=RuleConfig)  # a hook file's rules: defaults [/schema/rule@NAME]
    launchers.register()  # submitit's launchers, every ending reported


register()


def _extra_keys(node: DictConfig) -> tuple[list[str], list[str]]:
    """(the schema's field names, the node's keys outside them); no schema: ([], [])."""
    cls = OmegaConf.get_type(node)
    if not dataclasses.is_dataclass(cls):
        return [], []
    names = [f.name for f in dataclasses.fields(cls)]
    return names, [k for k in node.keys() if k not in names]


def unknown_key(key: str, names: list[str]) -> str:
    """One line for a key a schema does not have: the closest allowed name, then all of them."""
    parent, _, last = key.rpartition(".")
    close = difflib.get_close_matches(last, names, n=1)
    guess = f" (did you mean {parent + '.' if parent else ''}{close[0]}?)" if close else ""
    return f"unknown key {key}{guess}; allowed there: {', '.join(names)}"


def _unknown_keys(node: DictConfig, path: str) -> None:
    """``+key=value`` bypasses a schema's closed set of keys: check them here."""
    cls = OmegaConf.get_type(node)
    if dataclasses.is_dataclass(cls):
        names, extra = _extra_keys(node)
        if extra:
            raise ValueError(unknown_key(f"{path}{extra[0]}", names))
    if cls is dict or dataclasses.is_dataclass(cls):
        for key in node.keys():
            if key == "hooks" and not path:
                continue  # rules have their own checks
            child = node._get_node(key)
            if isinstance(child, DictConfig) and not child._is_missing() and not child._is_none():
                _unknown_keys(child, f"{path}{key}.")


TARGET_NODES = ("model", "data", "optimizer")  # a _target_ here takes the node's extra keys as arguments


def _target_arguments(cfg: DictConfig) -> None:
    """``model._target_=X +model.width=64``: the extra keys of a ``_target_`` node are the
    target's arguments (its ``args``); without a ``_target_`` they stay unknown keys."""
    for key in TARGET_NODES:
        node = cfg._get_node(key)
        if not isinstance(node, DictConfig) or node._is_missing() or node._is_none() or not node.get("_target_"):
            continue
        _, extra = _extra_keys(node)
        with open_dict(node):
            for k in extra:
                value = node._get_node(k)
                node.args[k] = (
                    OmegaConf.to_container(value, resolve=True)
                    if isinstance(value, DictConfig) or OmegaConf.is_list(value)
                    else node[k]
                )
                del node[k]


def one_line(e: OmegaConfBaseException) -> str:
    """OmegaConf's multi-line messages as ``full_key: message``."""
    msg = str(getattr(e, "msg", None) or e).strip().splitlines()[0]  # later lines: full_key, types
    key = getattr(e, "full_key", None)
    return f"{key}: {msg}" if key and key not in msg else msg


def _check_data_dir(cfg: DictConfig) -> None:
    if cfg.data.name != "mnist" or cfg.data.get("_target_"):
        return
    path = Path(str(cfg.data_dir))
    if path.exists() and (not path.is_dir() or not os.access(path, os.R_OK | os.X_OK)):
        raise ValueError(
            f"data_dir={str(path)!r} is not a readable folder; point data_dir at a folder "
            "holding MNIST (or where it may be downloaded)"
        )


def current_folder_first() -> None:
    """Put the current folder first on the import path, so that ``model._target_=my_pkg.Net``
    (and an optimizer's, checked below) imports from where the user runs ``train.py``, as
    ``plugins`` do: ``python train.py`` puts train.py's own folder there instead."""
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)


def as_built(cfg: DictConfig) -> DictConfig | None:
    """The composed config as the run will build it, for the saved ``.hydra/config.yaml``;
    None when that is ``cfg`` itself. A ``_target_`` node's ``name`` is its target (not the
    shipped default it replaced), and Grad-CAM's layer is null for a user's model without
    ``capture.gradcam`` (``conv2`` names a layer of the shipped CNN)."""
    targets = [
        k
        for k in TARGET_NODES
        if isinstance(cfg.get(k), DictConfig)
        and cfg[k].get("_target_")
        and "name" in cfg[k]
        and cfg[k].name != cfg[k]._target_
    ]
    if not targets:
        return None
    built = OmegaConf.create(OmegaConf.to_container(cfg))  # untyped: gradcam_layer may be null here
    for key in targets:
        built[key].name = built[key]._target_
    if "model" in targets and "capture" in built and not built.capture.gradcam:
        built.capture.gradcam_layer = None
    return built


def validate(cfg: DictConfig) -> Config:
    """Check ``cfg`` against the schemas and its values; a ``ValueError`` names the key."""
    current_folder_first()
    if OmegaConf.get_type(cfg) is not Config:
        cfg = OmegaConf.merge(OmegaConf.structured(Config), cfg)  # a hand-built config gets the schema
    _target_arguments(cfg)
    _unknown_keys(cfg, "")
    try:
        obj = OmegaConf.to_object(cfg)
    except MissingMandatoryValue as e:
        raise ValueError(f"{e.full_key} is missing (???); set it, e.g. {e.full_key}=...") from None
    except OmegaConfBaseException as e:
        cause = e.__cause__ if isinstance(e.__cause__, ValueError) else None
        raise ValueError(str(cause) if cause else one_line(e)) from None
    from gradmod.run.factories import check_optimizer  # torch: after the torch-free checks

    check_optimizer(obj.optimizer)  # the base optimizer and each optimizer.groups entry, before the model
    _check_data_dir(cfg)
    return obj
