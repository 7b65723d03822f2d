"""The per_loss rules of one ``attach`` call, from its targets, and what they refuse."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from torch import nn

from gradmod.hooks.per_loss.methods.bases import GramianWeighting, LossWeighting, Method
from gradmod.hooks.per_loss.record import TaskRecord


@dataclass
class LossRule:
    """One per_loss rule: its method, its parameters or modules, its statistics."""

    name: str
    method_name: str
    method: Method
    params: list[nn.Parameter] = field(default_factory=list)
    modules: list[nn.Module] = field(default_factory=list)
    record: TaskRecord = field(default_factory=TaskRecord)
    rows: str = "examples"  # a modules rule's Gramian: per-example rows, or each task's sum over the batch

    @property
    def key(self) -> str:
        return f"{self.name}/{self.method_name}"


ROWS = ("examples", "batch")  # a modules rule's Gramian: per-example rows, or batch-summed (LibMTL)


def check_rule(rule: str, kind: str, names: list[str], spec: Mapping[str, Any], rows_elsewhere: str) -> None:
    """One method per rule; ``rows`` (``rows_elsewhere``: its refusal on a params rule) on a modules rule."""
    if len(names) != 1:
        raise ValueError(
            f"hooks.{rule}.transforms: a per_loss rule holds exactly one method (what turns the task "
            f"gradients into one update), got {', '.join(names)}; put the others in rules of their own"
        )
    rows = spec.get("rows")
    if rows is not None and rows not in ROWS:
        raise ValueError(f"hooks.{rule}.rows: {rows!r}; allowed: {', '.join(ROWS)}")
    if rows is not None and kind != "module":
        raise ValueError(f"hooks.{rule}.rows: {rows_elsewhere}")


def check_targets(targets: list) -> None:
    """Each parameter gets one method's update (``targets``: every rule's)."""
    loss: dict[str, str] = {}
    for t in targets:
        if t.stage == "per_loss" and t.kind == "param":
            if t.name in loss:
                raise ValueError(
                    f"hooks.{t.rule}: {t.name!r} is also in per_loss rule {loss[t.name]!r}; "
                    "each parameter gets one method's update: select it in one"
                )
            loss[t.name] = t.rule


def several_passes(targets: list) -> tuple[Any, str] | None:
    """The first per_loss rule whose method runs one backward per task (a gradient method; a
    loss weighting runs one backward), and how, for messages."""
    t = next((t for t in targets if t.stage == "per_loss" and not isinstance(t.steps[0].fn, LossWeighting)), None)
    return None if t is None else (t, f"whose method {t.steps[0].name!r} runs one backward per task")


def per_loss_rules(targets: list, params: dict[str, nn.Parameter], modules: dict[str, nn.Module]) -> list[LossRule]:
    """The per_loss targets grouped by rule, in config order."""
    rules: dict[str, LossRule] = {}
    for t in targets:
        if t.stage != "per_loss":
            continue
        step = t.steps[0]
        if t.rule not in rules:
            if (
                t.rows is not None
                and not isinstance(step.fn, GramianWeighting)
                and not hasattr(step.fn, "aggregate_batch")
            ):
                raise ValueError(
                    f"hooks.{t.rule}.rows: only a Gramian method or graddrop has rows; {step.name!r} is "
                    f"{step.fn.kind!r}"
                )
        r = rules.setdefault(t.rule, LossRule(t.rule, step.name, step.fn, rows=t.rows or "examples"))
        if t.kind == "param":
            r.params.append(params[t.name])
        else:
            r.modules.append(modules[t.name])
    return list(rules.values())
