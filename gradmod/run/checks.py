"""The value checks of the typed config (``gradmod.run.config``): each refusal is one line
that names the key, the value it was given and what is allowed.

Torch-free, as the schemas are, so that a bad config is refused before torch loads (a
second or less). Most registries the choice keys pick from import torch, so their names are
restated here; ``tests/run/test_config_checks.py`` holds each equal to its registry.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gradmod.hooks import stages  # the stage table, torch-free
from gradmod.hooks.rules.syntax import transform_list  # how a rule's transforms are written, torch-free
from gradmod.run.host_heap import HOST_HEAPS  # torch-free

MODELS = ("mnist_cnn", "resnet18", "resnet50", "multi_lenet", "char_lm", "tiny_gpt", "dann")  # gradmod.models.MODELS
NORMS = ("batch", "group")  # gradmod.models.NORMS
DATASETS = ("mnist", "mnist_sample", "fake", "multi_mnist", "char_text", "dann_digits")  # gradmod.data.DATASETS
INITS = ("default", "xavier", "kaiming")  # gradmod.weight_init.INITS
HOOK_STAGES = stages.default_names()  # a stage for every rule: hook, fused
PRECISIONS = ("fp32", "bf16", "fp16")  # gradmod.training.precision.DTYPES
STRATEGIES = ("single", "ddp", "fsdp")  # gradmod.training.distributed.strategy.STRATEGIES
NONFINITE = ("skip", "raise", "warn")  # gradmod.training.nonfinite.POLICIES
PLACEMENTS = ("auto", "device", "loader")  # gradmod.training.loader.PLACEMENTS
SAMPLINGS = ("auto", "shuffle", "poisson")
ACCOUNTANTS = ("rdp", "prv")

LARGEST_INT = 2**63 - 1  # counts reach torch and C code (tqdm's len, tensor sizes) as 64-bit integers


def choice(key: str, value: Any, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{key}={value!r} is not allowed; allowed: {', '.join(map(str, allowed))}")


def at_least(key: str, value: Any, low: int) -> None:
    if value < low:
        raise ValueError(f"{key}={value} must be >= {low}")


def finite(key: str, value: Any, low: float = 0.0) -> None:
    """A float key that training would only diverge with when it is nan or infinite."""
    if not (math.isfinite(value) and value >= low):
        raise ValueError(f"{key}={value} must be a finite number >= {low:g}")


def int_fields(prefix: str, obj: Any) -> None:
    """Every int field of the dataclass ``obj`` within a 64-bit integer."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, int) and not isinstance(value, bool) and value > LARGEST_INT:
            raise ValueError(f"{prefix}{f.name}={value} is too large; allowed: at most {LARGEST_INT} (2**63 - 1)")


def target_or_choice(key: str, cfg: Any, allowed) -> None:
    """A ``_target_`` node is the user's object (``name`` becomes the target's path, for
    summaries); else ``name`` is a shipped one."""
    if cfg._target_ is not None:
        if not isinstance(cfg._target_, str) or "." not in cfg._target_:
            raise ValueError(f"{key}._target_={cfg._target_!r} must be a dotted path, e.g. my_pkg.module.Name")
        cfg.name = cfg._target_
    else:
        choice(f"{key}.name", cfg.name, allowed)


def target_node(key: str, node: Any, cls: type) -> Any:
    """A mapping from the config (``_target_``, ``_partial_`` and the call's arguments) as ``cls``."""
    if node is None or isinstance(node, cls):
        return node
    if not isinstance(node, dict) or not isinstance(node.get("_target_"), str):
        raise ValueError(f"{key} must be a mapping with a _target_ (a dotted path) and its arguments, got {node!r}")
    own = tuple(f.name for f in dataclasses.fields(cls) if f.name not in ("_target_", "_partial_", "args"))
    rest = {k: v for k, v in node.items() if k not in ("_target_", "_partial_", "args", *own)}
    return cls(
        _target_=node["_target_"],
        _partial_=bool(node.get("_partial_", cls._partial_)),
        args={**rest, **(node.get("args") or {})},
        **{k: node[k] for k in own if k in node},
    )


def seed(value: int) -> None:
    at_least("seed", value, 0)
    if value >= 2**64:  # torch.manual_seed's range
        raise ValueError(f"seed={value} must be < 2**64 ({2**64})")


def optimizer(opt: Any) -> None:
    """The optimizer's own values (``OptimizerConfig``); its arguments and ``groups`` need torch,
    and are checked after these (``gradmod.run.factories.check_optimizer``)."""
    if opt.fused and opt.foreach:
        raise ValueError(
            "optimizer.fused=true with optimizer.foreach=true: torch allows one of them; set the other null"
        )
    finite("optimizer.lr", opt.lr)
    finite("optimizer.weight_decay", opt.weight_decay)


METRIC_NAMES = ("auto", "accuracy", "rmse", "none")


def metric(key: str, spec: Any, by_task: bool = True) -> None:
    """``metric``: a name (``METRIC_NAMES``), a mapping with a ``_target_``, or (at the top)
    task name -> one of those."""
    if isinstance(spec, str):
        choice(key, spec, METRIC_NAMES)
    elif isinstance(spec, dict) and "_target_" in spec:
        if not isinstance(spec["_target_"], str) or "." not in spec["_target_"]:
            raise ValueError(f"{key}._target_={spec['_target_']!r} must be a dotted path, e.g. my_pkg.metrics.f1")
    elif isinstance(spec, dict) and by_task and spec:
        for task, inner in spec.items():
            metric(f"{key}.{task}", inner, by_task=False)
    else:
        raise ValueError(
            f"{key}={spec!r} is not allowed; allowed: {', '.join(METRIC_NAMES)}, "
            "{_target_: dotted.path, ...} or task name -> one of those"
        )


def trainer(t: Any) -> None:
    """The trainer's values (``TrainerConfig``)."""
    for key in ("epochs", "log_every", "eval_batch_size", "accumulate", "checkpoint_keep", "tp", "replicate"):
        at_least(f"trainer.{key}", getattr(t, key), 1)
    for key in ("threads", "checkpoint_every", "checkpoint_every_steps", "loader_workers"):
        at_least(f"trainer.{key}", getattr(t, key), 0)
    int_fields("trainer.", t)
    cores = os.cpu_count() or 1
    if t.threads > cores:  # each torch thread is an OS thread: far past the cores, starting them fails
        raise ValueError(
            f"trainer.threads={t.threads} is more than this machine's {cores} CPUs; "
            f"allowed: 0 (torch's default) to {cores}"
        )
    if t.hook_stage in stages.names() and t.hook_stage not in HOOK_STAGES:
        raise ValueError(
            f"trainer.hook_stage={t.hook_stage} is not allowed: {t.hook_stage} is a rule's own stage "
            f"(a {stages.get(t.hook_stage).implied_by} transform implies it); allowed: {', '.join(HOOK_STAGES)}"
        )
    for key, allowed in (
        ("hook_stage", HOOK_STAGES),
        ("precision", PRECISIONS),
        ("strategy", STRATEGIES),
        ("nonfinite", NONFINITE),
        ("data_placement", PLACEMENTS),
        ("host_heap", HOST_HEAPS),
    ):
        choice(f"trainer.{key}", getattr(t, key), allowed)
    if t.sync_check and (t.precision == "fp16" or t.nonfinite != "warn"):
        other = "trainer.precision=fp16" if t.precision == "fp16" else f"trainer.nonfinite={t.nonfinite}"
        raise ValueError(
            f"trainer.sync_check=true with {other}: that reads the host every step, which sync_check "
            "forbids; use trainer.sync_check=false, or precision fp32|bf16 and nonfinite=warn"
        )
    _resume(t.resume)


def _resume(resume: str | None) -> None:
    if resume not in (None, "auto") and Path(resume).is_dir():
        folder = Path(resume)
        run = folder.parent if folder.name == "checkpoints" else folder  # a run's checkpoints folder itself
        raise ValueError(
            f"trainer.resume={resume!r} is a folder; give a checkpoint file in it "
            f"({run / 'checkpoints'}/step-*.pt), or resume the run it holds with "
            f"trainer.resume=auto hydra.run.dir={run}"
        )
    if resume not in (None, "auto") and not Path(resume).is_file():
        raise ValueError(f"trainer.resume={resume!r}: no such file; allowed: auto, null or a checkpoint file")


def rules(hooks: Mapping[str, Any]) -> None:
    """The shape of each hook rule: a mapping whose transforms are names, mappings or a list
    of them. What they select and their arguments are checked against the model
    (``gradmod.hooks.rules.targets.build_targets``)."""
    for name, rule in hooks.items():
        if not isinstance(rule, Mapping):
            raise ValueError(
                f"hooks.{name}={rule!r} is not a rule; a rule is a mapping with params or modules and "
                f"transforms, e.g. +hooks.{name}={{params: '*', transforms: [zero]}}"
            )
        transforms = rule.get("transforms")
        listed = transform_list(transforms)
        if transforms is not None and not (
            isinstance(listed, list) and all(isinstance(t, (str, Mapping)) for t in listed)
        ):
            raise ValueError(
                f"hooks.{name}.transforms={transforms!r} is not allowed; allowed: a transform's name, "
                "a mapping {name: ..., its arguments}, or a list of them"
            )
