"""The user's own objects checked before training: one line naming what is wrong.

A dataset, model or loss given by ``_target_`` can be wrong in ways that would surface
only as a traceback inside the first step, or after a whole epoch (at evaluation), or as
a 6 TB allocation (a stray label of 10**9 sizes a shipped model's output layer). So:

* data (``check_data``, before the model is built): train and test inputs of one shape,
  ``uint8`` pixels or ``float32`` values, and no more classes than a model can hold;
* model and loss (``check_model``, before the hooks are attached): one forward of two
  training examples in eval mode (the random state put back) returns an N x classes
  tensor whose classes cover every label, and the loss of it is a scalar tensor that
  backpropagates into the model.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor, nn

from gradmod.data import Data, as_float

INPUT_DTYPES = (torch.uint8, torch.float32)
MAX_CLASSES = 100_000  # a shipped model's output layer: labels beyond this are a mistake, not classes


def check_data(data: Data, model_key: str | None) -> None:
    """``model_key``: ``model.name=...`` for a shipped model (sized by the labels), else None."""
    train, test = tuple(data.train_x.shape[1:]), tuple(data.test_x.shape[1:])
    if train != test:
        raise ValueError(f"data ({data.name}): train inputs are {_shape(train)} but test inputs are {_shape(test)}; "
                         "both splits need the same input shape")
    for split, x in (("train", data.train_x), ("test", data.test_x)):
        if x.dtype not in INPUT_DTYPES:
            raise ValueError(f"data ({data.name}): {split} inputs are {x.dtype}; allowed: torch.uint8 (pixels "
                             "0-255, scaled to [0, 1]) or torch.float32; convert them in the dataset, e.g. x.float()")
    if model_key is not None and data.num_classes > MAX_CLASSES:
        raise ValueError(f"data ({data.name}): the largest label is {data.num_classes - 1}, so {model_key} would need "
                         f"{data.num_classes} outputs; labels are class indices 0..C-1, C at most {MAX_CLASSES}")


def check_model(model: nn.Module, data: Data, loss_fn: Callable[[Tensor, Tensor], Any], model_key: str,
                loss_key: str) -> None:
    """One forward and loss of two training examples, as the first step would compute them."""
    device = next(model.parameters()).device
    x, y = as_float(data.train_x[:2].to(device)), data.train_y[:2].to(device)
    training = model.training
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        model.eval()  # no batch-norm statistics change
        try:
            out = model(x)
            _check_output(out, len(x), model_key)
            top = int(max(data.train_y.max(), data.test_y.max()))
            if top >= out.shape[1]:
                raise ValueError(f"data ({data.name}): label {top} is >= the {out.shape[1]} outputs of {model_key}; "
                                 f"labels are class indices 0..{out.shape[1] - 1}")
            _check_loss(loss_fn(out, y), loss_key)
        finally:
            model.train(training)


def _check_output(out: Any, n: int, key: str) -> None:
    if not isinstance(out, Tensor):
        raise ValueError(f"{key}: forward returned {_kind(out)}; it must return one tensor of logits, N x classes "
                         "(e.g. return out['logits'] or out[0] in forward)")
    if out.ndim != 2 or out.shape[0] != n:
        raise ValueError(f"{key}: forward returned a tensor of shape {tuple(out.shape)} for {n} inputs; "
                         "it must be N x classes")


def _check_loss(loss: Any, key: str) -> None:
    if not isinstance(loss, Tensor) or loss.ndim != 0:
        got = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, Tensor) else _kind(loss)
        raise ValueError(f"{key}: the loss returned {got}; it must return one scalar tensor "
                         "(reduce it, e.g. .mean())")
    if not loss.requires_grad:
        raise ValueError(f"{key}: the loss returned a tensor that does not depend on the model's output "
                         "(detached, or computed from .item()/numpy): no gradient can flow")


def _kind(obj: Any) -> str:
    if isinstance(obj, (tuple, list, dict)):
        return f"a {type(obj).__name__} of {len(obj)}"
    return f"a {type(obj).__name__}"


def _shape(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape)) or "scalars"
