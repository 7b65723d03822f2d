"""``tasks.png``: what a multi-task run's per_loss rules saw and did, and each task's numbers.

Panels, each only when there is something to draw: per rule, the cosine of each pair of task
gradients and the fraction of conflicting pairs against the step; per rule, the weight the
method gave each task; each task's test loss per epoch; each task's test metric per epoch,
one axis per task (an accuracy and an rmse do not share a scale).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence

from gradmod.reporting.plots import plt

Rows = Sequence[tuple[int, dict[str, Any]]]


def loss_rule_keys(rows: Rows) -> list[str]:
    """The keys (``rule/method``) of per_loss records: they carry ``cos/...`` or ``weight/...``."""
    found = [k for _, stats in rows for k, s in stats.items() if any(f.startswith(("cos/", "weight/")) for f in s)]
    return list(dict.fromkeys(found))


def _fields(rows: Rows, key: str, prefix: str) -> dict[str, tuple[list, list]]:
    """field (without ``prefix``) -> (steps, values) of one rule's record."""
    out: dict[str, tuple[list, list]] = {}
    for step, stats in rows:
        for field, value in (stats.get(key) or {}).items():
            if field.startswith(prefix) or field == prefix:
                xs, ys = out.setdefault(field.removeprefix(prefix) or field, ([], []))
                xs.append(step)
                ys.append(math.nan if value is None else value)
    return out


def _task_series(history: Sequence[dict[str, Any]], field: str) -> dict[str, tuple[list, list]]:
    out: dict[str, tuple[list, list]] = {}
    for h in history:
        for task, values in (h.get("tasks") or {}).items():
            if values.get(field) is not None:
                xs, ys = out.setdefault(task, ([], []))
                xs.append(h["epoch"])
                ys.append(values[field])
    return out


def has_tasks(rows: Rows, history: Sequence[dict[str, Any]]) -> bool:
    """Whether ``plot_tasks`` has anything to draw."""
    return bool(loss_rule_keys(rows)) or any(h.get("tasks") for h in history)


def plot_tasks(rows: Rows, history: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """``rows``: (step, stats) as ``HookSet.read_stats`` returns them; ``history``: the
    trainer's epoch records (``tasks: {name: {test_loss, test_metric, metric}}``)."""
    panels: list[tuple[str, str, str, dict[str, tuple[list, list]]]] = []  # (title, xlabel, ylabel, series)
    for key in loss_rule_keys(rows):
        cosines = {f"cos {pair}": v for pair, v in _fields(rows, key, "cos/").items()}
        conflict = _fields(rows, key, "conflict").get("conflict")
        if conflict is not None:
            cosines["conflicting pairs (fraction)"] = conflict
        if cosines:
            panels.append(
                (f"{key}: task-gradient cosines and conflicts", "optimizer step", "cosine, fraction", cosines)
            )
        weights = _fields(rows, key, "weight/")
        if weights:
            panels.append((f"{key}: the method's weight per task", "optimizer step", "weight", weights))
    losses = _task_series(history, "test_loss")
    if losses:
        panels.append(("test loss per task", "epoch", "test loss", losses))
    metrics = _task_series(history, "test_metric")
    names = {task: v.get("metric") or "metric" for h in history for task, v in (h.get("tasks") or {}).items()}
    for task, series in metrics.items():
        panels.append((f"task {task}: test {names.get(task)}", "epoch", names.get(task) or "metric", {task: series}))
    if not panels:
        raise ValueError("plot_tasks: no per_loss statistics and no per-task results to draw")
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 3.6 * len(panels)), squeeze=False)
    for ax, (title, xlabel, ylabel, series) in zip((a[0] for a in axes), panels):
        for label, (xs, ys) in series.items():
            ax.plot(xs, ys, label=label, marker="o" if len(xs) < 3 else None)
        ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
        if len(series) > 1 and len(series) <= 16:
            ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)
