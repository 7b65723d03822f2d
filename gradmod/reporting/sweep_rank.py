"""What a sweep's groups are ranked by (``report.metric``, ``report.direction``), and whether
the ranking means anything (the seed spread).

``report.metric``: ``auto`` (the test accuracy when the jobs report one, else the test loss),
``accuracy``, ``loss``, a task's name (its test metric: accuracy, rmse or one's own) or
``<task>/loss``. ``report.direction``: ``auto`` (accuracy higher is better; a loss and rmse
lower), ``higher`` or ``lower``; a metric of one's own has no known direction and needs one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DIRECTIONS = ("auto", "higher", "lower")
HIGHER = ("accuracy",)  # metrics a larger value of which is better
LOWER = ("rmse", "loss")


@dataclass(frozen=True)
class Ranking:
    metric: str  # as configured, resolved (auto -> accuracy or loss)
    label: str  # for the report: "test accuracy", "reg test rmse", ...
    higher: bool

    def value(self, row: dict[str, Any]) -> float | None:
        """The job's number for this ranking (None: it has none)."""
        if self.metric == "accuracy":
            return row.get("test_accuracy")
        if self.metric == "loss":
            return row.get("test_loss")
        task, _, part = self.metric.partition("/")
        found = (row.get("tasks") or {}).get(task) or {}
        return found.get("test_loss" if part == "loss" else "test_metric")

    @property
    def better(self) -> str:
        return "higher" if self.higher else "lower"


def _task_names(rows: list[dict[str, Any]]) -> list[str]:
    return list(dict.fromkeys(k for r in rows for k in r.get("tasks") or {}))


def ranking(rows: list[dict[str, Any]], metric: str = "auto", direction: str = "auto") -> Ranking:
    """The ranking ``report.metric`` and ``report.direction`` ask for; bad ones are one line."""
    if direction not in DIRECTIONS:
        raise ValueError(f"report.direction={direction!r}; allowed: {', '.join(DIRECTIONS)}")
    tasks = _task_names(rows)
    if metric == "auto":
        metric = "accuracy" if any(r.get("test_accuracy") is not None for r in rows) else "loss"
    task, _, part = metric.partition("/")
    if metric in ("accuracy", "loss"):
        name, label = metric, f"test {metric}"
    elif task in tasks and part in ("", "loss"):
        names = {((r.get("tasks") or {}).get(task) or {}).get("metric") for r in rows} - {None}
        name = "loss" if part else (names.pop() if len(names) == 1 else "?")
        label = f"{task} test {name}"
    else:
        allowed = ", ".join(["auto", "accuracy", "loss", *tasks, *(f"{t}/loss" for t in tasks)])
        raise ValueError(f"report.metric={metric!r}; allowed: {allowed}")
    if direction != "auto":
        return Ranking(metric, label, direction == "higher")
    if name not in HIGHER + LOWER:
        raise ValueError(
            f"report.metric={metric!r} is the metric {name!r}, whose better direction is not known; "
            "set report.direction=higher or report.direction=lower"
        )
    return Ranking(metric, label, name in HIGHER)


def ordered(groups: list[dict[str, Any]], rank: Ranking) -> list[dict[str, Any]]:
    """Best ``score`` first; groups without one last."""
    sign = -1.0 if rank.higher else 1.0
    return sorted(groups, key=lambda g: (g["score"] is None, 0.0 if g["score"] is None else sign * g["score"]))


def spread_note(groups: list[dict[str, Any]], rank: Ranking | None = None) -> str:
    """Which groups' score is within the seed spread of the best group's (their means differ
    by less than the larger of the two stds), so the ranking between them is noise."""
    ranked = [g for g in groups if g["score"] is not None]
    what = "accuracy" if rank is None else rank.label
    if len(ranked) < 2:
        return ""
    if all(g["score_std"] is None for g in ranked):
        return "One seed per group: no seed spread to compare the differences with (add e.g. seed=0,1,2)."
    best = ranked[0]
    close = [
        g
        for g in ranked[1:]
        if g["score_std"] is not None
        and best["score_std"] is not None
        and abs(best["score"] - g["score"]) <= max(best["score_std"], g["score_std"])
    ]
    if not close:
        return f"The best group, `{best['group']}`, is ahead of every other by more than the seed spread."
    names = ", ".join(f"`{g['group']}`" for g in close)
    return (
        f"Within the seed spread of the best group (`{best['group']}`): {names}; the {what} differences "
        "between them are smaller than the std over seeds, so they do not rank these settings."
    )
