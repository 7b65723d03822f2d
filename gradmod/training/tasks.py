"""What a step optimizes and what evaluation reports: the configured loss and metric, per task.

A model returns one tensor, or a mapping (or tuple) of outputs by task; the data holds one
label tensor or ``Labels`` by task. ``Tasks.losses`` gives one scalar loss, or a mapping of
named scalar losses: the configured loss applied to each task's output and labels
(``per_task``: when the model returns several outputs, unless set false), or a loss of the
user's own that takes the whole outputs and labels and returns a mapping itself.

The default loss (``loss=auto``, ``LossByTarget``) follows each task's target: class indices
(integers) get cross-entropy, float targets the mean squared error. ``check_fit`` refuses,
before training, a cross-entropy or NLL loss on float targets that are no class
probabilities and a regression loss on class indices or on targets of another shape.

Metrics (``metric``): ``accuracy`` (the argmax over dimension 1 equals the class label;
per token for sequences), ``rmse`` (the root of the mean squared error; lower is better),
``none``, a callable ``metric(output, target) -> scalar`` (the batch's mean), or ``auto``:
accuracy for integer class labels, rmse for float targets. One spec for every task, or a
mapping of task name -> spec. Evaluation reports the loss and the metric as
batch-size-weighted means over the test set, read from the device once (rmse: the root of
the mean of the batches' squared errors).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor

from gradmod.hooks.losses import total
from gradmod.labels import Labels

METRICS = ("auto", "accuracy", "rmse", "none")
SINGLE = ""  # the task name of a single-output, single-label run


IGNORE_INDEX = -100  # a class label left out of the loss (cross_entropy's default) and the accuracy


def accuracy(output: Tensor, target: Tensor) -> Tensor:
    """The fraction of predictions (argmax over dimension 1) equal to the class label, over
    the examples whose label is not ``IGNORE_INDEX`` (0 when none is labelled)."""
    labelled = target != IGNORE_INDEX
    right = (output.argmax(1) == target) & labelled
    return right.sum().float() / labelled.sum().clamp_min(1).float()


def squared_error(output: Tensor, target: Tensor) -> Tensor:
    """The batch's mean squared error; evaluation reports the root of its mean (``rmse``)."""
    return F.mse_loss(output.float(), _like(target, output).float())


def _like(target: Tensor, output: Tensor) -> Tensor:
    """A target of N numbers for an output of N x 1 (or the reverse), reshaped to match."""
    return target.reshape(output.shape) if target.shape != output.shape and target.numel() == output.numel() else target


class LossByTarget:
    """The default loss: cross-entropy for class indices, mean squared error for float targets.
    ``label_smoothing``, ``weight`` and ``ignore_index`` are cross-entropy's (class indices
    only); ``reduction`` both losses'."""

    def __init__(
        self, label_smoothing: float = 0.0, weight: Any = None, ignore_index: int = -100, reduction: str = "mean"
    ):
        self.class_args = {"label_smoothing": label_smoothing, "ignore_index": ignore_index, "reduction": reduction}
        self.weight = None if weight is None else torch.as_tensor(weight, dtype=torch.float32)
        self.reduction = reduction

    def __call__(self, output: Tensor, target: Tensor) -> Tensor:
        if is_class_labels(target):
            weight = None if self.weight is None else self.weight.to(output.device, output.dtype)
            loss = F.cross_entropy(output, target, weight=weight, **self.class_args)
            if self.reduction != "mean":
                return loss
            # a batch whose every label is ignore_index averages over nothing (0/0): it
            # adds nothing instead (a loss of 0, zero gradients)
            return torch.where(target.ne(self.class_args["ignore_index"]).any(), loss, 0.0)
        return F.mse_loss(output, _like(target, output), reduction=self.reduction)

    def __repr__(self) -> str:
        return "LossByTarget()"


CLASS_LOSSES = (torch.nn.CrossEntropyLoss, torch.nn.NLLLoss, F.cross_entropy, F.nll_loss)
REGRESSION_LOSSES = (
    torch.nn.MSELoss,
    torch.nn.L1Loss,
    torch.nn.SmoothL1Loss,
    torch.nn.HuberLoss,
    F.mse_loss,
    F.l1_loss,
    F.smooth_l1_loss,
    F.huber_loss,
)


def _family(fn: Any) -> str | None:
    inner = getattr(fn, "func", fn)  # functools.partial
    if inner in CLASS_LOSSES or isinstance(inner, CLASS_LOSSES[:2]):
        return "class"
    if inner in REGRESSION_LOSSES or isinstance(inner, REGRESSION_LOSSES[:4]):
        return "regression"
    return None


def check_fit(loss_fn: Any, task: str, output: Tensor, target: Tensor, loss_key: str = "loss") -> None:
    """Refuse in one line a known loss that does not fit the task's target: cross-entropy or
    NLL on float targets that are no class probabilities shaped like the output; a
    regression loss on class indices, or on targets of another number of values."""
    family = _family(loss_fn)
    which = f"task {task!r}" if task else "the target"
    if family == "class" and not is_class_labels(target):
        probabilities = (
            target.shape == output.shape
            and bool((target >= 0).all())
            and bool(torch.allclose(target.sum(1), torch.ones(1)))
        )
        if not probabilities:
            raise ValueError(
                f"{loss_key} is a cross-entropy (class) loss, and {which} has float targets of shape "
                f"{tuple(target.shape)} that are no class probabilities; use loss=auto (mean squared error "
                "for float targets) or loss=mse"
            )
    if family == "regression":
        if is_class_labels(target):
            raise ValueError(
                f"{loss_key} is a regression loss, and {which} has class indices ({target.dtype}); "
                "use loss=auto (cross-entropy for class indices) or loss=cross_entropy"
            )
        if target.numel() != output.numel():
            raise ValueError(
                f"{loss_key} is a regression loss, and {which} has targets of shape {tuple(target.shape)} "
                f"for outputs of shape {tuple(output.shape)}; they must hold as many values"
            )


def is_class_labels(y: Tensor) -> bool:
    return not y.dtype.is_floating_point and y.dtype != torch.bool


def scaled(losses: Tensor | Mapping[str, Tensor], fn: Callable[[Tensor], Tensor]) -> Tensor | dict[str, Tensor]:
    """``fn`` applied to each loss (a micro-batch's 1/k, GradScaler's scale)."""
    return fn(losses) if isinstance(losses, Tensor) else {k: fn(v) for k, v in losses.items()}


def by_task(output: Any, y: Tensor | Labels) -> dict[str, tuple[Tensor, Tensor]]:
    """(output, labels) per task: a mapping of outputs matched to ``Labels`` by name, a tuple
    by the labels' order, one tensor with one label tensor as the task ``SINGLE``."""
    if isinstance(output, Tensor) and isinstance(y, Tensor):
        return {SINGLE: (output, y)}
    if isinstance(output, (tuple, list)) and isinstance(y, Labels) and len(output) == len(y.keys()):
        output = dict(zip(y.keys(), output))
    if isinstance(output, Mapping) and isinstance(y, Labels) and set(output) == set(y.keys()):
        return {k: (output[k], y[k]) for k in y.keys()}
    raise ValueError(
        f"the model returned {_kind(output)} and the data holds {_kind(y)}: outputs and labels "
        "must match, one tensor with one label tensor, or a mapping (or tuple) of outputs with "
        "labels by the same task names"
    )


def _kind(obj: Any) -> str:
    if isinstance(obj, Tensor):
        return "one tensor"
    if isinstance(obj, Labels):
        return f"labels for {', '.join(obj.keys())}"
    if isinstance(obj, Mapping):
        return f"outputs for {', '.join(map(str, obj))}"
    if isinstance(obj, (tuple, list)):
        return f"a {type(obj).__name__} of {len(obj)} outputs"
    return f"a {type(obj).__name__}"


class Tasks:
    """The configured loss and metric(s). ``metric``: one spec (``METRICS`` or a callable),
    or task name -> spec; ``per_task``: None (per task when the model returns several
    outputs), True or False (the loss takes the whole outputs and labels)."""

    def __init__(self, loss_fn: Callable[..., Any], metric: Any = "auto", per_task: bool | None = None):
        self.loss_fn, self.metric, self.per_task = loss_fn, metric, per_task

    def losses(self, output: Any, y: Tensor | Labels) -> Tensor | dict[str, Tensor]:
        """One scalar loss, or named scalar losses (a dict)."""
        multi_output = not isinstance(output, Tensor)
        if self.per_task or (self.per_task is None and multi_output):
            return {k: self.loss_fn(o, t) for k, (o, t) in by_task(output, y).items()}
        made = self.loss_fn(output, y)
        return dict(made) if isinstance(made, Mapping) else made

    def check(self, output: Any, y: Tensor | Labels, loss_key: str = "loss") -> None:
        """``check_fit`` for each task the configured loss is applied to on its own."""
        several = not isinstance(output, Tensor)
        if self.per_task is False or (several and self.per_task is None and not isinstance(y, Labels)):
            return
        for task, (o, t) in by_task_or_single(output, y).items():
            check_fit(self.loss_fn, task, o, t, loss_key)

    def metric_of(self, task: str, y: Tensor) -> Callable[[Tensor, Tensor], Tensor] | None:
        """The task's metric function (None: no metric), ``auto`` resolved by its labels."""
        spec = self.metric.get(task, "auto") if isinstance(self.metric, Mapping) else self.metric
        if callable(spec):
            return spec
        if spec == "auto":
            return accuracy if is_class_labels(y) else squared_error
        if spec == "rmse":
            if is_class_labels(y):
                where = f"metric.{task}" if task else "metric"
                raise ValueError(
                    f"{where}=rmse needs float targets, and the labels are {y.dtype}; use {where}=accuracy"
                )
            return squared_error
        if spec == "accuracy":
            if not is_class_labels(y):
                where = f"metric.{task}" if task else "metric"
                raise ValueError(
                    f"{where}=accuracy needs integer class labels, and the labels are {y.dtype}; "
                    f"use {where}=none or a _target_ metric"
                )
            return accuracy
        if spec == "none":
            return None
        raise ValueError(f"metric={spec!r} is not allowed; allowed: {', '.join(METRICS)} or a _target_")

    def metric_name(self, task: str, y: Tensor) -> str:
        """``accuracy``, ``rmse``, ``none`` or the callable's name, for summaries and reports."""
        fn = self.metric_of(task, y)
        return "none" if fn is None else "accuracy" if fn is accuracy else "rmse" if fn is squared_error else _name(fn)

    def metrics(self, output: Any, y: Tensor | Labels) -> dict[str, Tensor]:
        """Task -> the batch's metric, for the tasks that have one."""
        out = {}
        pairs = by_task(output, y) if self.metric not in ("auto", "none") else by_task_or_single(output, y)
        for task, (o, t) in pairs.items():
            fn = self.metric_of(task, t)
            if fn is not None:
                out[task] = torch.as_tensor(fn(o, t)).detach().float().reshape(())
        return out

    def describe(self, output: Any, y: Tensor | Labels) -> str:
        """``metric: accuracy`` or ``metrics: left=accuracy, right=none`` for the start of a run."""
        found = by_task_or_single(output, y)
        unknown = [k for k in self.metric if k not in found] if isinstance(self.metric, Mapping) else []
        if unknown:
            raise ValueError(
                f"metric.{unknown[0]}: there is no task {unknown[0]!r}; the tasks are "
                f"{', '.join(found) or '(none: one output)'}"
            )
        pairs = [(task, self.metric_name(task, t)) for task, (_, t) in found.items()]
        if not pairs:
            return "metric: none (the outputs and labels do not pair by task)"
        if pairs == [(SINGLE, pairs[0][1])]:
            return f"metric: {pairs[0][1]}"
        return "metrics: " + ", ".join(f"{k}={v}" for k, v in pairs)


def _name(fn: Any) -> str:
    inner = getattr(fn, "func", fn)  # functools.partial
    return f"{getattr(inner, '__module__', '')}.{getattr(inner, '__qualname__', type(inner).__name__)}".lstrip(".")


CROSS_ENTROPY = Tasks(torch.nn.functional.cross_entropy, "accuracy")  # classification (the Python API's default)


def evaluation_sums(tasks: Tasks, output: Any, y: Tensor | Labels) -> dict[str, Tensor]:
    """One batch's loss and metrics times its size: ``loss`` (the total), ``loss/<task>``
    for named losses, ``metric/<task>`` (task ``SINGLE`` for a one-output run)."""
    n = len(y)
    losses = tasks.losses(output, y)
    sums = {"loss": total(losses).detach().float() * n}
    if not isinstance(losses, Tensor):
        sums.update({f"loss/{k}": v.detach().float() * n for k, v in losses.items()})
    sums.update({f"metric/{k}": v * n for k, v in tasks.metrics(output, y).items()})
    return sums


def results(means: Mapping[str, float], metric_names: Mapping[str, str]) -> dict[str, Any]:
    """The record's test fields from the means of ``evaluation_sums`` and each task's metric
    name: ``test_loss``; ``test_metric`` (a one-output run's metric, else None);
    ``test_accuracy`` (the accuracy, or the mean of the tasks' accuracies when every task's
    metric is accuracy; else None); with named tasks, ``tasks: {name: {test_loss, test_metric,
    metric}}`` (``metric``: the metric's name, as ``Tasks.metric_name``)."""
    names = list(dict.fromkeys([k.split("/", 1)[1] for k in means if "/" in k]))
    means = {k: _root(k, v, metric_names) for k, v in means.items()}
    out: dict[str, Any] = {"test_loss": means["loss"], "test_metric": means.get(f"metric/{SINGLE}")}
    accuracies = [means.get(f"metric/{k}") for k, m in metric_names.items() if m == "accuracy"]
    every = metric_names and len(accuracies) == len(metric_names)
    out["test_accuracy"] = sum(accuracies) / len(accuracies) if every else None
    if names and names != [SINGLE]:
        out["tasks"] = {
            k: {
                "test_loss": means.get(f"loss/{k}"),
                "test_metric": means.get(f"metric/{k}"),
                "metric": metric_names.get(k),
            }
            for k in names
        }
    return out


def _root(key: str, value: float, metric_names: Mapping[str, str]) -> float:
    """rmse: the root of the mean squared error the batches summed."""
    task = key.split("/", 1)[1] if key.startswith("metric/") else None
    return math.sqrt(value) if task is not None and metric_names.get(task) == "rmse" and value >= 0 else value


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    x: Tensor,
    y: Tensor | Labels,
    tasks: Tasks = CROSS_ENTROPY,
    *,
    batch_size: int = 1000,
    device: torch.device | None = None,
    loader_workers: int | None = None,
    parts: int | None = None,
    stand_in: tuple[Tensor, Tensor | Labels] | None = None,
) -> tuple[dict[str, float], dict[str, str]]:
    """Batched evaluation: (the means of ``evaluation_sums`` over the examples, read from the
    device once; each task's metric name). ``parts``: exactly that many batches (FSDP2).
    ``stand_in``: an (x, y) example of the whole test set that an empty batch (a rank's share
    smaller than its parts) runs instead, counting nothing, so that every rank runs as many
    forward passes and returns the same keys."""
    from gradmod.training.loader import batches

    model.eval()
    device = y.device if device is None else device
    sums: dict[str, Tensor] = {}
    names: dict[str, str] = {}
    for xb, yb in batches(x, y, batch_size, device=device, loader_workers=loader_workers, parts=parts):
        empty = len(yb) == 0 and stand_in is not None
        if empty:
            x_in, y_in = stand_in
            xb, yb = next(batches(x_in, y_in, 1, device=device, loader_workers=loader_workers))
        out = model(xb)
        for k, v in evaluation_sums(tasks, out, yb).items():
            v = torch.zeros_like(v) if empty else v
            sums[k] = sums[k] + v if k in sums else v
        if not names:
            names = {task: tasks.metric_name(task, t) for task, (_, t) in by_task_or_single(out, yb).items()}
    keys = list(sums)
    values = torch.stack([sums[k] for k in keys]).tolist() if keys else []
    return {k: v / max(len(y), 1) for k, v in zip(keys, values)}, names


def by_task_or_single(output: Any, y: Tensor | Labels) -> dict[str, tuple[Tensor, Tensor]]:
    """``by_task``, or nothing when a loss of the user's own takes outputs ``by_task`` cannot pair."""
    try:
        return by_task(output, y)
    except ValueError:
        return {}
