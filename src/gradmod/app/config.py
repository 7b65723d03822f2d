"""Config schemas: Hydra structured configs that make bad input fail before any work.

``Config`` is the base of ``conf/config.yaml`` (``defaults: [base_config, ...]``), so a
typo (``trainer.epoch=3``) or a wrong type (``trainer.epochs=abc``) fails while Hydra
composes. ``validate(cfg)`` then builds the dataclasses (``OmegaConf.to_object``), whose
``__post_init__`` checks values, and checks what a schema cannot: keys added with ``+``,
the optimizer's arguments, the data folder. Every failure is a one-line ``ValueError``.

Data, optimizer and logger options differ in their keys, so each option file names its schema
(``defaults: [schema_fake]``); the schemas are subclasses of the root's field type.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

# The allowed values live with the code that implements them.
from gradmod.training.distributed import STRATEGIES
from gradmod.training.loader import PLACEMENTS
from gradmod.reporting.loggers import LOGGERS
from gradmod.training.nonfinite import POLICIES as NONFINITE
from gradmod.training.precision import DTYPES
from gradmod.hooks.rules import STAGES as HOOK_STAGES

PRECISIONS = tuple(DTYPES)


def choice(key: str, value: Any, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{key}={value!r} is not allowed; allowed: {', '.join(map(str, allowed))}")


def at_least(key: str, value: Any, low: int) -> None:
    if value < low:
        raise ValueError(f"{key}={value} must be >= {low}")


@dataclass
class ModelConfig:
    name: str = MISSING

    def __post_init__(self):
        from gradmod.models import MODELS

        choice("model.name", self.name, MODELS)


@dataclass
class DataConfig:
    name: str = MISSING
    batch_size: int = 100
    fallback: bool = True  # mnist offline: use the bundled sample instead of failing
    n_test: int = 1000

    def __post_init__(self):
        from gradmod.data import DATASETS

        choice("data.name", self.name, DATASETS)
        at_least("data.batch_size", self.batch_size, 1)
        at_least("data.n_test", self.n_test, 1)


@dataclass
class FakeDataConfig(DataConfig):
    train_size: int = 256
    test_size: int = 64
    image_size: int = 224
    channels: int = 3
    num_classes: int = 10

    def __post_init__(self):
        super().__post_init__()
        for key in ("train_size", "test_size", "image_size", "channels"):
            at_least(f"data.{key}", getattr(self, key), 1)
        at_least("data.num_classes", self.num_classes, 2)


@dataclass
class OptimizerConfig:
    _target_: str = MISSING
    _partial_: bool = True  # the parameters come later, from the built model
    lr: float = 0.001
    weight_decay: float = 0.0

    def __post_init__(self):
        if self.lr < 0 or self.weight_decay < 0:
            key, value = ("lr", self.lr) if self.lr < 0 else ("weight_decay", self.weight_decay)
            raise ValueError(f"optimizer.{key}={value} must be >= 0")


@dataclass
class AdamConfig(OptimizerConfig):
    _target_: str = "torch.optim.Adam"
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8

    def __post_init__(self):
        super().__post_init__()
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"optimizer.betas={list(self.betas)} must be two numbers in [0, 1)")


@dataclass
class SGDConfig(OptimizerConfig):
    _target_: str = "torch.optim.SGD"
    lr: float = 0.01
    momentum: float = 0.0
    nesterov: bool = False

    def __post_init__(self):
        super().__post_init__()
        at_least("optimizer.momentum", self.momentum, 0)


@dataclass
class TrainerConfig:
    epochs: int = 10
    device: str = "auto"
    progress: bool = True
    log_every: int = 50
    eval_batch_size: int = 1000
    hook_stage: str = "hook"
    threads: int = 0
    precision: str = "fp32"
    compile: bool = False
    channels_last: bool = False
    accumulate: int = 1
    strategy: str = "single"
    checkpoint_every: int = 1
    checkpoint_every_steps: int = 0
    checkpoint_keep: int = 2
    resume: Optional[str] = None
    nonfinite: str = "warn"
    data_placement: str = "auto"
    loader_workers: int = 2
    sync_check: bool = False

    def __post_init__(self):
        for key in ("epochs", "log_every", "eval_batch_size", "accumulate", "checkpoint_keep"):
            at_least(f"trainer.{key}", getattr(self, key), 1)
        for key in ("threads", "checkpoint_every", "checkpoint_every_steps", "loader_workers"):
            at_least(f"trainer.{key}", getattr(self, key), 0)
        choice("trainer.hook_stage", self.hook_stage, HOOK_STAGES)
        choice("trainer.precision", self.precision, PRECISIONS)
        choice("trainer.strategy", self.strategy, STRATEGIES)
        choice("trainer.nonfinite", self.nonfinite, NONFINITE)
        choice("trainer.data_placement", self.data_placement, PLACEMENTS)
        if self.sync_check and (self.precision == "fp16" or self.nonfinite != "warn"):
            other = "trainer.precision=fp16" if self.precision == "fp16" else f"trainer.nonfinite={self.nonfinite}"
            raise ValueError(f"trainer.sync_check=true with {other}: that reads the host every step, which sync_check "
                             "forbids; use trainer.sync_check=false, or precision fp32|bf16 and nonfinite=warn")
        if self.resume not in (None, "auto") and not Path(self.resume).is_file():
            raise ValueError(f"trainer.resume={self.resume!r}: no such file; allowed: auto, null or a checkpoint file")


@dataclass
class InitConfig:
    name: str = "default"

    def __post_init__(self):
        from gradmod.weight_init import INITS

        choice("init.name", self.name, INITS)


@dataclass
class LoggerConfig:
    name: str = "csv"

    def __post_init__(self):
        choice("logger.name", self.name, LOGGERS)


@dataclass
class TensorBoardLoggerConfig(LoggerConfig):
    name: str = "tensorboard"
    histograms: bool = True


@dataclass
class CaptureConfig:
    gradcam: bool = False
    gradcam_layer: str = "conv2"
    gradcam_images: int = 8

    def __post_init__(self):
        at_least("capture.gradcam_images", self.gradcam_images, 1)


@dataclass
class Config:
    model: ModelConfig = MISSING
    data: DataConfig = MISSING
    optimizer: OptimizerConfig = MISSING
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    init: InitConfig = field(default_factory=InitConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    capture: CaptureConfig = field(default_factory=CaptureConfig)
    seed: int = 1234
    data_dir: str = "data"
    hooks: Dict[str, Any] = field(default_factory=dict)  # rules, checked by gradmod.hooks.rules.build_targets
    clip_bound: Optional[float] = None  # the tuned clamp bound of conf/experiment/clip_optuna.yaml


def register() -> None:
    """Put the schemas in Hydra's ConfigStore (done on import; harmless to repeat)."""
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    cs.store(group="data", name="schema_data", node=DataConfig)
    cs.store(group="data", name="schema_fake", node=FakeDataConfig)
    cs.store(group="optimizer", name="schema_adam", node=AdamConfig)
    cs.store(group="optimizer", name="schema_sgd", node=SGDConfig)
    cs.store(group="logger", name="schema_tensorboard", node=TensorBoardLoggerConfig)


register()


def _unknown_keys(node: DictConfig, path: str) -> None:
    """``+key=value`` bypasses a schema's closed set of keys: check them here."""
    cls = OmegaConf.get_type(node)
    if dataclasses.is_dataclass(cls):
        names = [f.name for f in dataclasses.fields(cls)]
        extra = [k for k in node.keys() if k not in names]
        if extra:
            where = path or "the config"
            raise ValueError(f"unknown key {path}{extra[0]} in {where.rstrip('.')}; allowed: {', '.join(names)}")
    if cls is dict or dataclasses.is_dataclass(cls):
        for key in node.keys():
            if key == "hooks" and not path:
                continue  # rules have their own checks
            child = node._get_node(key)
            if isinstance(child, DictConfig) and not child._is_missing() and not child._is_none():
                _unknown_keys(child, f"{path}{key}.")


def one_line(e: OmegaConfBaseException) -> str:
    """OmegaConf's multi-line messages as ``full_key: message``."""
    msg = str(getattr(e, "msg", None) or e).strip().splitlines()[0]  # later lines: full_key, types
    key = getattr(e, "full_key", None)
    return f"{key}: {msg}" if key and key not in msg else msg


def _check_optimizer(opt: DictConfig) -> None:
    import torch
    from hydra.utils import get_class, instantiate

    target = opt.get("_target_")
    try:
        cls = get_class(target)
    except Exception:
        raise ValueError(f"optimizer._target_={target!r} is not an importable class; "
                         "e.g. torch.optim.Adam, torch.optim.SGD") from None
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ValueError(f"optimizer._target_={target!r} is not a torch.optim.Optimizer")
    try:  # the constructor checks its own arguments: try them on a dummy parameter
        instantiate(opt)([torch.zeros(1, requires_grad=True)])
    except Exception as e:
        cause = e.__cause__ or e
        raise ValueError(f"optimizer ({target}): {' '.join(str(cause).split())}") from None


def _check_data_dir(cfg: DictConfig) -> None:
    if cfg.data.name != "mnist":
        return
    path = Path(str(cfg.data_dir))
    if path.exists() and (not path.is_dir() or not os.access(path, os.R_OK | os.X_OK)):
        raise ValueError(f"data_dir={str(path)!r} is not a readable folder; point data_dir at a folder "
                         "holding MNIST (or where it may be downloaded)")


def validate(cfg: DictConfig) -> Config:
    """Check ``cfg`` against the schemas and its values; a ``ValueError`` names the key."""
    if OmegaConf.get_type(cfg) is not Config:
        return cfg  # hand-built configs: the run's own checks still apply
    _unknown_keys(cfg, "")
    try:
        obj = OmegaConf.to_object(cfg)
    except MissingMandatoryValue as e:
        raise ValueError(f"{e.full_key} is missing (???); set it, e.g. {e.full_key}=...") from None
    except OmegaConfBaseException as e:
        cause = e.__cause__ if isinstance(e.__cause__, ValueError) else None
        raise ValueError(str(cause) if cause else one_line(e)) from None
    _check_optimizer(cfg.optimizer)
    _check_data_dir(cfg)
    return obj
