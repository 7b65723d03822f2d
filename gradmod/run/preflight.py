"""The user's own objects checked before training: one line naming what is wrong.

A dataset, model or loss given by ``_target_`` can be wrong in ways that would surface
only as a traceback inside the first step, or after a whole epoch (at evaluation), or as
a 6 TB allocation (a stray label of 10**9 sizes a shipped model's output layer). So:

* data (``check_data``, before the model is built): train and test inputs of one shape,
  ``uint8`` pixels, ``float32`` values or ``int64`` token ids, and no more classes than a
  model can hold;
* model, loss and metric (``check_model``, before the hooks are attached): one forward of
  two training examples in eval mode (the random state put back) returns a tensor with a
  row per example (or a mapping or tuple of them, one per task's labels) whose classes
  cover every class label, the loss of it is a scalar tensor (or a mapping of named
  scalars) that backpropagates into the model, and the metric applies to the labels; the
  parameters every loss reaches are noted for ``@shared`` (``gradmod.hooks.rules.shared``);
  with ``trainer.compile=true``, a loss (or forward) that differentiates a gradient it takes
  of itself through the model (a gradient penalty), which a compiled model cannot, is refused.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from gradmod.data import Data, as_float
from gradmod.hooks import stages
from gradmod.hooks.rules import shared as shared_params
from gradmod.labels import Labels
from gradmod.training.tasks import SINGLE, Tasks, by_task, is_class_labels

INPUT_DTYPES = (torch.uint8, torch.float32, torch.int64)
MAX_CLASSES = 100_000  # a shipped model's output layer: labels beyond this are a mistake, not classes


def check_data(data: Data, model_key: str | None) -> None:
    """``model_key``: ``model.name=...`` for a shipped model (sized by the labels), else None."""
    train, test = tuple(data.train_x.shape[1:]), tuple(data.test_x.shape[1:])
    if train != test:
        raise ValueError(
            f"data ({data.name}): train inputs are {_shape(train)} but test inputs are {_shape(test)}; "
            "both splits need the same input shape"
        )
    for split, x in (("train", data.train_x), ("test", data.test_x)):
        if x.dtype not in INPUT_DTYPES:
            raise ValueError(
                f"data ({data.name}): {split} inputs are {x.dtype}; allowed: torch.uint8 (pixels "
                "0-255, scaled to [0, 1]), torch.float32 or torch.int64 (token ids); convert them in "
                "the dataset, e.g. x.float()"
            )
    if model_key is not None and data.num_classes > MAX_CLASSES:
        raise ValueError(
            f"data ({data.name}): the largest label is {data.num_classes - 1}, so {model_key} would need "
            f"{data.num_classes} outputs; labels are class indices 0..C-1, C at most {MAX_CLASSES}"
        )


def check_model(
    model: nn.Module, data: Data, tasks: Tasks, model_key: str, loss_key: str, compiled: bool = False
) -> tuple[bool, str]:
    """One forward, loss and metric of two training examples, as the first step would compute
    them; returns (whether the loss is several named losses, the metrics for the log).
    ``compiled``: the model will be compiled (``trainer.compile=true``)."""
    device = next(model.parameters()).device
    x, y = as_float(data.train_x[:2].to(device)), data.train_y[:2].to(device)
    training = model.training
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        model.eval()  # no batch-norm statistics change
        try:
            with _double_backward(model) as seen:
                out = _forward(model, x, data, model_key)
                pairs = _pairs(out, y, model_key)
                for task, (o, t) in pairs.items():
                    _check_classes(data, task, o, t, model_key)
                tasks.check(out, y, loss_key)  # a loss that does not fit a task's targets
                losses = _losses(tasks, out, y, loss_key)
            if compiled and seen:
                raise ValueError(
                    f"trainer.compile=true: {loss_key} (or {model_key}'s forward) differentiates a gradient it "
                    "takes of itself through the model (torch.autograd.grad with create_graph=True: a gradient "
                    "penalty), which a compiled model's backward cannot (torch.compile runs no double backward); "
                    "set trainer.compile=false"
                )
            _check_loss(losses, loss_key, len(x))
            shared_params.find(model, losses)  # what @shared in a rule stands for
            tasks.metrics(out, y)  # a metric that does not apply to the labels fails here
            return not isinstance(losses, Tensor), tasks.describe(out, y)
        finally:
            model.train(training)


@contextmanager
def _double_backward(model: nn.Module) -> Iterator[list[bool]]:
    """Inside: whether a backward that builds a graph (``create_graph=True``) ran into the forward
    of ``model`` or a module of it (beyond the gradient of its output): a gradient differentiated again."""
    seen: list[bool] = []
    mine = {id(m) for m in model.modules()}

    def into(grad_fn: Any) -> Any:
        def hook(grad: Tensor) -> None:
            if torch.is_grad_enabled() and not seen and _runs_below(grad_fn):
                seen.append(True)

        return hook

    def on_output(module: nn.Module, args: Any, output: Any) -> None:
        for t in pytree.tree_leaves(output) if id(module) in mine else ():
            if isinstance(t, Tensor) and t.grad_fn is not None:
                t.register_hook(into(t.grad_fn))

    handle = nn.modules.module.register_module_forward_hook(on_output)
    try:
        yield seen
    finally:
        handle.remove()


def _runs_below(grad_fn: Any) -> bool:
    """The backward in progress runs a node under ``grad_fn`` (it goes into the module)."""
    for node, _ in grad_fn.next_functions:
        if node is None:
            continue
        try:
            if torch._C._will_engine_execute_node(node):
                return True
        except RuntimeError:  # autograd.grad captures a parameter's gradient there
            return True
    return False


def check_per_loss(targets: list[Any], named_losses: bool, strategy: str, loss_key: str) -> None:
    """A rule at a stage that combines several named losses (per_loss) needs them, and runs
    on one process or under DDP."""
    combining = [t for t in targets if stages.get(t.stage).several_losses]
    if not combining:
        return
    rules, stage = list(dict.fromkeys(t.rule for t in combining)), combining[0].stage
    if not named_losses:
        raise ValueError(
            f"hooks.{rules[0]} runs at stage {stage}, which combines several losses, and {loss_key} "
            "gives one scalar loss; use a model with several outputs (e.g. model=multi_lenet "
            "data=multi_mnist) or a loss that returns a mapping of named losses"
        )
    if strategy == "fsdp":
        raise ValueError(
            f"hooks.{rules[0]} runs at stage {stage}, which trainer.strategy=fsdp does not support "
            "yet; use trainer.strategy=ddp or single"
        )


def _forward(model: nn.Module, x: Tensor, data: Data, key: str) -> Any:
    if x.dtype != torch.int64:
        return model(x)
    try:
        return model(x)
    except (RuntimeError, TypeError) as e:
        raise ValueError(
            f"data ({data.name}): train inputs are torch.int64 (token ids) and {key} fails on them "
            f"({type(e).__name__}: {' '.join(str(e).split())[:200]}); a model of token ids starts "
            "with an nn.Embedding; for numbers convert them in the dataset, e.g. x.float()"
        ) from None


def _pairs(out: Any, y: Tensor | Labels, key: str) -> dict[str, tuple[Tensor, Tensor]]:
    """(output, labels) per task, each output a tensor with a row per example."""
    n = len(y)
    if isinstance(y, Tensor) and not isinstance(out, Tensor):
        raise ValueError(
            f"{key}: forward returned {_kind(out)} and the data has one label tensor; it must return "
            "one tensor of N x classes logits (e.g. return out['logits'] or out[0] in forward), or the "
            "data must give labels by task"
        )
    try:
        pairs = by_task(out, y)
    except ValueError as e:
        raise ValueError(f"{key}: {e}") from None
    for task, (o, _) in pairs.items():
        if not isinstance(o, Tensor) or o.ndim < 1 or o.shape[0] != n:
            got = f"a tensor of shape {tuple(o.shape)}" if isinstance(o, Tensor) else _kind(o)
            where = f"output {task!r}" if task != SINGLE else "forward"
            raise ValueError(f"{key}: {where} returned {got} for {n} inputs; it must be N x classes (N x ...)")
    return pairs


def _check_classes(data: Data, task: str, out: Tensor, y: Tensor, key: str) -> None:
    """Every class label of the task (train and test) has an output, where the labels are classes."""
    if not is_class_labels(y) or out.ndim < 2 or not out.dtype.is_floating_point:
        return
    train, test = (data.train_y, data.test_y) if task == SINGLE else (data.train_y[task], data.test_y[task])
    top = int(max(train.max(), test.max()))
    if top >= out.shape[1]:
        what = "label" if task == SINGLE else f"label of {task!r}"
        raise ValueError(
            f"data ({data.name}): {what} {top} is >= the {out.shape[1]} outputs of {key}; "
            f"labels are class indices 0..{out.shape[1] - 1}"
        )


def _losses(tasks: Tasks, out: Any, y: Tensor | Labels, key: str) -> Tensor | dict[str, Tensor]:
    """The loss of the two examples; a library's loss (``torch.nn.MSELoss``) that fails on
    these outputs and labels is one line (an error in the user's own loss keeps its frame)."""
    from gradmod.run.folder.endings import one_line, user_frame

    try:
        with warnings.catch_warnings(record=True) as said:  # torch's broadcast warning before the error
            warnings.simplefilter("always")
            losses = tasks.losses(out, y)
        for w in said:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        return losses
    except (RuntimeError, ValueError, TypeError, IndexError) as e:
        if user_frame(e) is not None:
            raise
        labels = "class labels" if isinstance(y, Tensor) and is_class_labels(y) else "labels"
        got = f" on outputs {_shape_of(out)} and {labels} {_shape_of(y)}"
        hint = (
            "; class labels take a classification loss (loss=cross_entropy), a regression loss "
            "(loss=mse) needs float targets of the output's shape"
            if labels == "class labels"
            else ""
        )
        raise ValueError(f"{key}: the loss fails{got} ({type(e).__name__}: {one_line(str(e))[:200]}){hint}") from None


def _shape_of(x: Any) -> str:
    if isinstance(x, Tensor):
        return f"{_shape(tuple(x.shape))} {str(x.dtype).removeprefix('torch.')}"
    return _kind(x)


def _check_loss(loss: Any, key: str, n: int) -> None:
    if isinstance(loss, dict):
        if not loss:
            raise ValueError(f"{key}: the loss returned an empty mapping; it must name one or more scalar losses")
        for name, part in loss.items():
            _check_loss(part, f"{key} (its loss {name!r})", n)
        return
    if not isinstance(loss, Tensor) or loss.ndim != 0:
        got = (  # (a per-example loss shows the check batch's size, not the run's)
            f"a tensor of shape {tuple(loss.shape)} on a check batch of {n} examples"
            if isinstance(loss, Tensor)
            else _kind(loss)
        )
        raise ValueError(
            f"{key}: the loss returned {got}; it must return one scalar tensor "
            "(reduce it, e.g. .mean()), or a mapping of named scalar losses"
        )
    if not loss.requires_grad:
        raise ValueError(
            f"{key}: the loss returned a tensor that does not depend on the model's output "
            "(detached, or computed from .item()/numpy): no gradient can flow"
        )


def _kind(obj: Any) -> str:
    if isinstance(obj, (tuple, list, dict)):
        return f"a {type(obj).__name__} of {len(obj)}"
    return f"a {type(obj).__name__}"


def _shape(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape)) or "scalars"
