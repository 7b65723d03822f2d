"""The console's one line per epoch: what someone watching a run, or reading its redirected
output, needs to see that it goes on and how well."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

BOOKKEEPING = ("epoch", "step", "seconds", "train_seconds", "eval_seconds", "skipped_steps", "grad_stats")


def epoch_line(numbers: Mapping[str, Any], epochs: int | None = None, rates: Sequence[float] = ()) -> str:
    """``epoch 2/10: train_loss 0.4123 test_loss 0.3981 test_accuracy 0.8812 epsilon 1.234 (3.1 s)``:
    every number of an epoch's record in its order (losses, test metrics, epsilon: whatever
    the record holds; a mapping's as ``name.key``, each task's) but the bookkeeping;
    skipped steps where there were some. ``rates``: the learning rates of the optimizer's
    parameter groups; the record's ``lr`` (the first group's) shows every distinct one of
    them (``lr 0.02/0.0003``), or, where the record names them (``lr_groups``), each by name
    (``lr adamw=0.0003 muon=0.02 muon.adjusted=0.04``)."""
    head = f"epoch {numbers.get('epoch', '?')}" + (f"/{epochs}" if epochs else "")
    distinct = list(dict.fromkeys(float(r) for r in rates))
    named = numbers.get("lr_groups") or {}
    shown = [
        "lr " + " ".join(f"{name}={_number(r)}" for name, r in named.items())
        if key == "lr" and named
        else f"lr {'/'.join(_number(r) for r in distinct)}"
        if key == "lr" and len(distinct) > 1
        else f"{key} {_number(value)}"
        for key, value in _flat(numbers)
        if not key.startswith("lr_groups.")
    ]
    if numbers.get("skipped_steps"):
        shown.append(f"skipped_steps {numbers['skipped_steps']}")
    seconds = numbers.get("seconds")
    return f"{head}: {' '.join(shown)}" + (f" ({seconds:.1f} s)" if _is_number(seconds) else "")


def _flat(numbers: Mapping[str, Any], prefix: str = "") -> list[tuple[str, float]]:
    out = []
    for key, value in numbers.items():
        if key in BOOKKEEPING or (key == "test_metric" and value == numbers.get("test_accuracy")):
            continue  # a one-output classifier's metric is the accuracy already shown
        if isinstance(value, Mapping) and not prefix:
            out += (
                _flat(value, f"{key}.")
                if key != "tasks"
                else [kv for task, inner in value.items() if isinstance(inner, Mapping) for kv in _task(task, inner)]
            )
        elif _is_number(value):
            out.append((prefix + key, value))
    return out


def _task(name: str, numbers: Mapping[str, Any]) -> list[tuple[str, float]]:
    """A task's numbers as ``name.key``, its metric under its own name (``left.test_rmse``)."""
    metric = numbers.get("metric")
    return [
        (f"{name}.test_{metric}" if key == f"{name}.test_metric" and isinstance(metric, str) else key, value)
        for key, value in _flat(numbers, f"{name}.")
    ]


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _number(value: float) -> str:
    return str(value) if isinstance(value, int) else f"{value:.4g}"
