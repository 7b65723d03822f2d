"""The run's objects from its config: the model, data and loss (shipped names, or the user's
``_target_`` objects), the optimizer with its parameter groups, and the schedule; built
without Hydra.

The contract, as in Hydra: a ``_target_`` is called with the arguments its config node
holds (``args``) and nothing gradmod adds. A model target returns an ``nn.Module``; a data
target returns ``(train, test)``, each a map-style dataset of ``(input, label)`` pairs or
a pair of tensors ``(inputs, labels)``, the labels one tensor (class indices, or float
targets for regression) or a mapping of them by task; a loss target returns
``loss(output, target)``; a metric target ``metric(output, target)``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
from typing import Any, Callable, Mapping

import torch
from torch import Tensor, nn
from torch.optim import lr_scheduler

from gradmod.data import Data, load_data
from gradmod.hooks.groupnorm import replace_batchnorm
from gradmod.labels import Labels, class_count
from gradmod.models import build_model
from gradmod.optim import optimizer as optimizer_by_spec
from gradmod.optim.param_groups import LR_SCALE, check_step, locate, optimizer_class
from gradmod.optim.spec import BASE_EXAMPLE, check
from gradmod.run.config import DataConfig, LossConfig, ModelConfig, OptimizerConfig, SchedulerConfig
from gradmod.run.keep import keep_share
from gradmod.training.tasks import IGNORE_INDEX, Tasks

log = logging.getLogger("gradmod.run.runner")  # the run's lines keep the name users filter on

DATA_SHAPE = "must return (train, test), each a map-style dataset of (input, label) pairs or a pair of tensors"
TOTAL_KEYS = ("T_max", "total_steps", "total_iters")  # null: the run's number of optimizer steps
# torch's schedulers that set every group's rate from their own arguments, not from its initial rate
ABSOLUTE_RATES = {lr_scheduler.OneCycleLR: ("max_lr",), lr_scheduler.CyclicLR: ("base_lr", "max_lr")}
# Optimizers with a fused CUDA implementation that gives the same updates (torch's docs).
FUSED_ON_CUDA = ("Adam", "AdamW", "SGD")


def arguments(cfg: Any) -> dict[str, Any]:
    """A config dataclass's fields as keyword arguments, without Hydra's ``_target_``-style keys."""
    return {k: v for k, v in dataclasses.asdict(cfg).items() if not (k.startswith("_") and k.endswith("_"))}


def call_target(key: str, cfg: Any, *args: Any) -> Any:
    """``cfg._target_(*args, **cfg.args)``; a failing call is one line naming ``key``."""
    fn = locate(cfg._target_, f"{key}._target_")
    try:
        return fn(*args, **cfg.args)
    except Exception as e:
        shown = ", ".join(f"{k}={v!r}" for k, v in cfg.args.items())
        raise ValueError(
            f"{key}._target_={cfg._target_}({shown}) failed: {type(e).__name__}: {' '.join(str(e).split())}"
        ) from None


def default_fused(cls: type, device: torch.device) -> bool | None:
    """``optimizer.fused=null``: fused kernels on CUDA for the optimizers that have them
    (one launch for all parameters), torch's own choice elsewhere."""
    if (
        torch.device(device).type == "cuda"
        and getattr(cls, "__name__", "") in FUSED_ON_CUDA
        and cls.__module__.startswith("torch.optim")
    ):
        return True
    return None


def optimizer_spec(cfg: OptimizerConfig, device: torch.device | str = "cpu") -> dict[str, Any]:
    """The ``optimizer`` node as ``gradmod.optimizer``'s spec: its keys, ``fused`` chosen by
    ``default_fused`` when it and ``foreach`` are null."""
    spec = {"_target_": cfg._target_, **arguments(cfg)}
    if cfg.fused is None and not cfg.foreach:
        spec["fused"] = default_fused(optimizer_class(cfg._target_, "optimizer._target_", BASE_EXAMPLE), device)
    return spec


def model_optimizer(
    cfg: OptimizerConfig, model: nn.Module, device: torch.device | str = "cpu"
) -> torch.optim.Optimizer:
    """The run's optimizer over every parameter of ``model`` (one frozen now and unfrozen later
    trains), in the groups ``optimizer.groups`` and ``optimizer.no_decay`` make: what
    ``gradmod.optimizer`` builds of the node, one torch optimizer or several as one."""
    return optimizer_by_spec(model, optimizer_spec(cfg, device))


def check_optimizer(cfg: OptimizerConfig) -> None:
    """The ``optimizer`` node checked before the model exists (``gradmod.optim.spec.check``:
    classes, arguments and values of the base optimizer and of each group entry); the run
    steps without a closure, so an optimizer that needs one is refused too."""
    check(optimizer_spec(cfg))
    base = optimizer_class(cfg._target_, "optimizer._target_", BASE_EXAMPLE)
    check_step(base, "optimizer._target_", "the run steps it without one")


def model_factory(cfg: ModelConfig, data: Data) -> Callable[[], nn.Module]:
    """A function that builds a fresh model as the config says (also for Grad-CAM's copy)."""
    if cfg._target_ is None:
        return functools.partial(
            build_model,
            cfg.name,
            in_channels=data.in_channels,
            num_classes=data.num_classes,
            image_size=data.image_size,
            norm=cfg.norm,
        )
    return functools.partial(_target_model, cfg)


def _target_model(cfg: ModelConfig) -> nn.Module:
    model = call_target("model", cfg)
    if not isinstance(model, nn.Module):
        raise ValueError(f"model._target_={cfg._target_} returned a {type(model).__name__}, not a torch.nn.Module")
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(f"model._target_={cfg._target_} returned a module without trainable parameters")
    if cfg.norm == "group":  # per-example gradients need no batch statistics: GroupNorm, as the shipped ResNets
        model = replace_batchnorm(model)
    return model


def build_data(cfg: DataConfig, *, data_dir: str, seed: int) -> Data:
    """The dataset on the CPU: by name (``gradmod.data.load_data``) or from ``data._target_``, with
    the share of its training set ``data.keep`` keeps (``gradmod.run.keep``)."""
    return keep_share(_load_data(cfg, data_dir=data_dir, seed=seed), cfg.keep, seed)


def _load_data(cfg: DataConfig, *, data_dir: str, seed: int) -> Data:
    if cfg._target_ is None:
        extra = {
            k: v
            for k, v in vars(cfg).items()
            if k not in ("name", "batch_size", "fallback", "n_test", "sampling", "keep", "_target_", "args")
        }
        return load_data(cfg.name, data_dir=data_dir, seed=seed, fallback=cfg.fallback, n_test=cfg.n_test, **extra)
    made = call_target("data", cfg)
    if not isinstance(made, (tuple, list)) or len(made) != 2:
        raise ValueError(f"data._target_={cfg._target_} {DATA_SHAPE}; got {_describe(made)}")
    (train_x, train_y), (test_x, test_y) = (
        _tensors(cfg._target_, part, split) for part, split in zip(made, ("train", "test"))
    )
    num_classes = max(class_count(train_y), class_count(test_y))
    return Data(cfg._target_, train_x, train_y, test_x, test_y, num_classes=max(num_classes, 2))


def _tensors(target: str, part: Any, split: str) -> tuple[Tensor, Tensor | Labels]:
    """(inputs, labels) from a pair of tensors or a map-style dataset of pairs; labels by
    task (a mapping) become ``Labels``."""
    where = f"data._target_={target} {DATA_SHAPE}; its {split} part"
    if (
        isinstance(part, (tuple, list))
        and len(part) == 2
        and isinstance(part[0], Tensor)
        and (isinstance(part[1], Tensor) or _tensor_map(part[1]))
    ):
        x, y = part
    elif hasattr(part, "__getitem__") and hasattr(part, "__len__"):
        if len(part) == 0:
            raise ValueError(f"{where} is empty")
        items = [part[i] for i in range(len(part))]
        if not all(isinstance(it, (tuple, list)) and len(it) == 2 for it in items):
            raise ValueError(f"{where} holds {_describe(items[0])}, not (input, label) pairs")
        x = torch.stack([torch.as_tensor(it[0]) for it in items])
        y = _stacked([it[1] for it in items])
    else:
        raise ValueError(f"{where} is {_describe(part)}")
    if isinstance(y, Mapping):
        return x, Labels({str(k): _checked(f"{where}, labels {k!r},", x, v) for k, v in y.items()})
    return x, _checked(where, x, y)


def _tensor_map(obj: Any) -> bool:
    return isinstance(obj, Mapping) and bool(obj) and all(isinstance(v, Tensor) for v in obj.values())


def _stacked(labels: list[Any]) -> Tensor | dict[str, Tensor]:
    if isinstance(labels[0], Mapping):
        return {k: _stacked([it[k] for it in labels]) for k in labels[0]}
    stacked = torch.stack([torch.as_tensor(it) for it in labels])
    if not stacked.dtype.is_floating_point and stacked[0].numel() == 1:
        return stacked.reshape(len(labels))  # a class index per example, however it was wrapped
    return stacked


def _checked(where: str, x: Tensor, y: Tensor) -> Tensor:
    """Class indices as int64, regression targets as float32."""
    if x.ndim < 2 or y.ndim < 1 or len(x) != len(y) or len(y) == 0:
        raise ValueError(
            f"{where} has inputs of shape {tuple(x.shape)} and labels of shape {tuple(y.shape)}; "
            "want N x ... inputs and N labels"
        )
    if y.dtype.is_floating_point:
        return y.float()
    labelled = y[y != IGNORE_INDEX]  # -100: an unlabelled example, which cross-entropy leaves out
    if y.dtype == torch.bool or (labelled.numel() and int(labelled.min()) < 0):
        raise ValueError(
            f"{where} has labels that are neither class indices (integers >= 0, or {IGNORE_INDEX} for none) "
            "nor float targets"
        )
    return y.long()


def _describe(obj: Any) -> str:
    if isinstance(obj, Tensor):
        return f"a tensor of shape {tuple(obj.shape)}"
    if isinstance(obj, (tuple, list)):
        return f"a {type(obj).__name__} of {len(obj)}"
    return f"a {type(obj).__name__}"


def build_loss(cfg: LossConfig) -> Callable[[Tensor, Tensor], Tensor]:
    """``loss(output, target)``: ``_target_(**args)``, or ``partial(_target_, **args)`` with ``_partial_``."""
    if cfg._partial_:
        fn = functools.partial(locate(cfg._target_, "loss._target_"), **cfg.args)
    else:
        fn = call_target("loss", cfg)
    if not callable(fn):
        raise ValueError(
            f"loss._target_={cfg._target_} returned a {type(fn).__name__}, which is not callable "
            "as loss(output, target); use _partial_: true for a function"
        )
    return fn


def build_metric(spec: Any) -> Any:
    """``metric``: a name as it is, a ``_target_`` mapping as the callable it builds (as a
    loss's), task name -> either of those as a dict of them."""
    if isinstance(spec, str):
        return spec
    if isinstance(spec, Mapping) and "_target_" in spec:
        rest = {k: v for k, v in spec.items() if k not in ("_target_", "_partial_", "args")}
        node = LossConfig(spec["_target_"], bool(spec.get("_partial_", False)), {**rest, **(spec.get("args") or {})})
        try:
            return build_loss(node)
        except ValueError as e:
            raise ValueError(str(e).replace("loss._target_", "metric._target_")) from None
    return {task: build_metric(inner) for task, inner in spec.items()}


def build_tasks(loss: LossConfig, metric: Any) -> Tasks:
    """The configured loss and metric(s), per task (``gradmod.training.tasks``)."""
    return Tasks(build_loss(loss), build_metric(metric), loss.per_task)


def _unset_totals(fn: Any, args: dict[str, Any]) -> list[str]:
    """The length keys (``TOTAL_KEYS``) ``fn`` takes that the config leaves out, where the run's
    length is what they mean: required, or None by default (OneCycleLR's ``total_steps``,
    unless ``epochs`` is given instead)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return []
    return [
        k
        for k in TOTAL_KEYS
        if k in params
        and k not in args
        and "epochs" not in args
        and params[k].default in (inspect.Parameter.empty, None)
    ]


def build_scheduler(
    cfg: SchedulerConfig | None, optimizer: torch.optim.Optimizer, total_steps: int
) -> lr_scheduler.LRScheduler | None:
    """``cfg._target_(optimizer, **args)``, with null ``T_max``/``total_steps``/``total_iters``
    filled in as ``total_steps``; None without a scheduler."""
    if cfg is None:
        return None
    args = {k: (total_steps if k in TOTAL_KEYS and v is None else v) for k, v in cfg.args.items()}
    args.update({k: total_steps for k in _unset_totals(locate(cfg._target_, "scheduler._target_"), args)})
    filled = SchedulerConfig(_target_=cfg._target_, _partial_=cfg._partial_, args=args)
    made = call_target("scheduler", filled, optimizer)
    if not hasattr(made, "step") or not hasattr(made, "state_dict"):
        raise ValueError(
            f"scheduler._target_={cfg._target_} returned a {type(made).__name__}, "
            "not a torch.optim.lr_scheduler object (no step/state_dict)"
        )
    dropped = dropped_lr_scales(made, args, optimizer)
    if dropped:
        log.warning("%s", dropped)
    return made


def dropped_lr_scales(scheduler: Any, args: Mapping[str, Any], optimizer: torch.optim.Optimizer) -> str | None:
    """The line to say where ``scheduler`` sets every group's rate from one number of ``args``
    (OneCycleLR's ``max_lr``, CyclicLR's ``base_lr`` and ``max_lr``), so an ``optimizer.groups``
    entry's ``lr_scale`` is not applied; None where it is (those arguments are lists, one rate
    per group) or no group has one."""
    keys = next((k for cls, k in ABSOLUTE_RATES.items() if isinstance(scheduler, cls)), ())
    single = [k for k in keys if not isinstance(args.get(k), (list, tuple))]
    scaled = {g["entry"]: g[LR_SCALE] for g in optimizer.param_groups if g.get(LR_SCALE, 1.0) != 1.0}
    if not single or not scaled:
        return None
    entries = ", ".join(f"optimizer.groups.{i}'s lr_scale={s:g}" for i, s in scaled.items())
    given = ", ".join(f"{k}={args.get(k)!r}" for k in single)
    return (
        f"scheduler: {type(scheduler).__name__} sets every group's rate from {given}, so {entries} is not applied; "
        f"give {' and '.join(single)} a list, one rate per group ({len(optimizer.param_groups)} groups, "
        "in the order of the printed optimizer groups)"
    )
