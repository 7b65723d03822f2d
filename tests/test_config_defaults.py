"""gradmod/conf/ restates the typed config's defaults where users read them: the two must agree."""

from __future__ import annotations

import dataclasses

import pytest
import yaml
from helpers import CONF

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


@pytest.mark.parametrize("name, schema", [("optimizer/sgd.yaml", C.SGDConfig),
                                          ("optimizer/adam.yaml", C.AdamConfig),
                                          ("logger/tensorboard.yaml", C.TensorBoardLoggerConfig),
                                          ("logger/csv.yaml", C.LoggerConfig),
                                          ("init/default.yaml", C.InitConfig),
                                          ("loss/cross_entropy.yaml", C.LossConfig)])
def test_option_files_restate_their_schema_defaults(name, schema):
    data, defaults = _yaml(name), _defaults(schema)
    assert set(data) <= set(defaults), f"{name} sets keys its schema lacks"
    assert data == {k: defaults[k] for k in data}


def test_root_yaml_restates_the_root_defaults():
    data, defaults = _yaml("config.yaml"), _defaults(C.Config)
    assert {k: data[k] for k in ("seed", "data_dir", "hooks", "plugins")} == \
        {k: defaults[k] for k in ("seed", "data_dir", "hooks", "plugins")}
    assert data["capture"] == _defaults(C.CaptureConfig)


def test_sgd_momentum_is_the_same_in_python_and_in_the_config(compose_cfg):
    """Python users building SGDConfig() get what ``optimizer=sgd`` gives."""
    assert C.SGDConfig().momentum == compose_cfg("optimizer=sgd").optimizer.momentum == 0.9
