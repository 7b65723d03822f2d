"""The per_loss rules of one ``attach`` call, from its targets, and what they refuse."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from gradmod.hooks.per_loss.methods import Method, check_method
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


def check_targets(targets: list) -> None:
    """Each parameter gets one method's update, after no hook- or per_sample-stage rule
    (``targets``: every rule's)."""
    loss: dict[str, str] = {}
    for t in targets:
        if t.stage == "per_loss" and t.kind == "param":
            if t.name in loss:
                raise ValueError(
                    f"hooks.{t.rule}: {t.name!r} is also in per_loss rule {loss[t.name]!r}; "
                    "each parameter gets one method's update: select it in one"
                )
            loss[t.name] = t.rule
    clash = next(
        (t for t in targets if t.kind == "param" and t.name in loss and t.stage in ("hook", "per_sample")), None
    )
    if clash is not None:
        raise ValueError(
            f"hooks.{clash.rule}: {clash.name!r} is in per_loss rule {loss[clash.name]!r}, whose update "
            f"replaces the gradient a {clash.stage}-stage rule would act on; a parameter is per_loss "
            "or per_sample, not both (a fused rule after it is fine)"
        )
    # A module's output hook fires in every pass of a gradient method's backward (one per task,
    # then the rest): it would see each task's gradient in turn, never one gradient.
    passes = next(  # (a malformed method, without a kind, is refused with the rules)
        (t for t in targets if t.stage == "per_loss" and getattr(t.steps[0].fn, "kind", "losses") != "losses"), None
    )
    watched = next((t for t in targets if t.stage == "hook" and t.kind == "module"), None)
    if passes is not None and watched is not None:
        raise ValueError(
            f"hooks.{watched.rule}: a hook-stage modules rule ({watched.key!r}) does not combine with "
            f"per_loss rule {passes.rule!r}, whose method {passes.steps[0].name!r} runs one backward per "
            "task, so the output's hook would see each task's gradient in turn; use a params rule (a "
            "fused one sees the combined gradient)"
        )
    # On other parameters too: the per_sample stage follows one backward of one loss, and the
    # per_loss stage runs several passes (and scales the heads' .grad back after one).
    sample = next((t for t in targets if t.stage == "per_sample"), None)
    multi = next((t for t in targets if t.stage == "per_loss"), None)
    if sample is not None and multi is not None:
        raise ValueError(
            f"hooks.{sample.rule}: a per_sample rule does not combine with per_loss rule "
            f"{multi.rule!r} (its method runs the backward passes of several losses itself, "
            "which the per_sample stage cannot follow); use one of them"
        )


def per_loss_rules(targets: list, params: dict[str, nn.Parameter], modules: dict[str, nn.Module]) -> list[LossRule]:
    """The per_loss targets grouped by rule, in config order."""
    rules: dict[str, LossRule] = {}
    for t in targets:
        if t.stage != "per_loss":
            continue
        step = t.steps[0]
        if t.rule not in rules:
            check_method(step.name, step.fn)  # a factory of one's own may build anything
            if t.rows is not None and step.fn.kind != "gramian" and not hasattr(step.fn, "aggregate_batch"):
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
