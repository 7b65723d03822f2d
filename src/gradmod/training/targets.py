"""The model, data and loss of a run: shipped names, or the user's ``_target_`` objects.

The contract, as in Hydra: a ``_target_`` is called with the arguments its config node
holds (``args``) and nothing gradmod adds. A model target returns an ``nn.Module``; a data
target returns ``(train, test)``, each a map-style dataset of ``(input, label)`` pairs or
a pair of tensors ``(inputs, labels)``; a loss target returns ``loss(output, target)``.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch import Tensor, nn

from gradmod.data import Data, load_data
from gradmod.models import build_model
from gradmod.training.build import call_target, locate
from gradmod.training.config import DataConfig, LossConfig, ModelConfig

DATA_SHAPE = "must return (train, test), each a map-style dataset of (input, label) pairs or a pair of tensors"


def model_factory(cfg: ModelConfig, data: Data) -> Callable[[], nn.Module]:
    """A function that builds a fresh model as the config says (also for Grad-CAM's copy)."""
    if cfg._target_ is None:
        return functools.partial(build_model, cfg.name, in_channels=data.in_channels, num_classes=data.num_classes,
                                 image_size=data.image_size)
    return functools.partial(_target_model, cfg)


def _target_model(cfg: ModelConfig) -> nn.Module:
    model = call_target("model", cfg)
    if not isinstance(model, nn.Module):
        raise ValueError(f"model._target_={cfg._target_} returned a {type(model).__name__}, not a torch.nn.Module")
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(f"model._target_={cfg._target_} returned a module without trainable parameters")
    return model


def build_data(cfg: DataConfig, *, data_dir: str, seed: int) -> Data:
    """The dataset on the CPU: by name (``gradmod.data.load_data``) or from ``data._target_``."""
    if cfg._target_ is None:
        extra = {k: v for k, v in vars(cfg).items()
                 if k not in ("name", "batch_size", "fallback", "n_test", "_target_", "args")}
        return load_data(cfg.name, data_dir=data_dir, seed=seed, fallback=cfg.fallback, n_test=cfg.n_test, **extra)
    made = call_target("data", cfg)
    if not isinstance(made, (tuple, list)) or len(made) != 2:
        raise ValueError(f"data._target_={cfg._target_} {DATA_SHAPE}; got {_describe(made)}")
    (train_x, train_y), (test_x, test_y) = (_tensors(cfg._target_, part, split) for part, split in
                                            zip(made, ("train", "test")))
    num_classes = int(max(train_y.max(), test_y.max())) + 1
    return Data(cfg._target_, train_x, train_y, test_x, test_y, num_classes=max(num_classes, 2))


def _tensors(target: str, part: Any, split: str) -> tuple[Tensor, Tensor]:
    """(inputs, int64 labels) from a pair of tensors or a map-style dataset of pairs."""
    where = f"data._target_={target} {DATA_SHAPE}; its {split} part"
    if isinstance(part, (tuple, list)) and len(part) == 2 and all(isinstance(t, Tensor) for t in part):
        x, y = part
    elif hasattr(part, "__getitem__") and hasattr(part, "__len__"):
        if len(part) == 0:
            raise ValueError(f"{where} is empty")
        items = [part[i] for i in range(len(part))]
        if not all(isinstance(it, (tuple, list)) and len(it) == 2 for it in items):
            raise ValueError(f"{where} holds {_describe(items[0])}, not (input, label) pairs")
        x = torch.stack([torch.as_tensor(it[0]) for it in items])
        y = torch.as_tensor([torch.as_tensor(it[1]).item() for it in items])
    else:
        raise ValueError(f"{where} is {_describe(part)}")
    if x.ndim < 2 or y.ndim != 1 or len(x) != len(y) or len(y) == 0:
        raise ValueError(f"{where} has inputs of shape {tuple(x.shape)} and labels of shape {tuple(y.shape)}; "
                         "want N x ... inputs and N labels")
    if y.dtype.is_floating_point or y.dtype == torch.bool or int(y.min()) < 0:
        raise ValueError(f"{where} has labels that are not class indices (integers >= 0)")
    return x, y.long()


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
        raise ValueError(f"loss._target_={cfg._target_} returned a {type(fn).__name__}, which is not callable "
                         "as loss(output, target); use _partial_: true for a function")
    return fn
