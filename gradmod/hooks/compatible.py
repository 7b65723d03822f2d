"""What the stages of one ``attach`` call combine with, checked once, before anything is
attached, from the facts each stage states in its row of ``gradmod.hooks.stages`` (so no
stage checks another by name). Each refusal is one line:

* a parameter whose gradient a stage writes itself (``replaces_grad``) is in no rule of an
  earlier stage, which would act on the gradient it replaces, nor of another such stage;
* a stage whose hooks act in every backward pass (``sees_each_pass``) holds no module output
  while a rule runs one backward pass per task (``Stage.several_passes``);
* two stages that run the step's backward themselves (``runs_backward``) do not combine, nor
  one of them with a stage that counts each example's gradient once (``counts_examples``).
"""

from __future__ import annotations

from typing import Any

from gradmod.hooks import stages


def check(targets: list[Any]) -> None:
    """Refuse the first combination of ``targets``' stages that cannot hold (every rule's targets)."""
    _replaced_gradients(targets)
    _passes(targets)
    _own_backwards(targets)


def _after(stage: str) -> str:
    """The stages after ``stage`` that act on the accumulated ``.grad`` in place, for messages."""
    return " or ".join(s.name for s in stages.STAGES if s.in_place and stages.order(s.name) > stages.order(stage))


def _replaced_gradients(targets: list[Any]) -> None:
    held: dict[str, list[Any]] = {}
    for t in targets:
        if t.kind == "param":
            held.setdefault(t.name, []).append(t)
    for name, rules in held.items():
        rules = sorted(rules, key=lambda t: stages.order(t.stage))
        owner = next((t for t in rules if stages.get(t.stage).replaces_grad), None)
        if owner is None:
            continue
        before = stages.order(owner.stage)
        other = next(
            (
                t
                for t in rules
                if t.stage != owner.stage and (stages.order(t.stage) < before or stages.get(t.stage).replaces_grad)
            ),
            None,
        )
        if other is not None:
            raise ValueError(
                f"hooks.{other.rule}: a {other.stage}-stage rule on {name!r}, which {owner.stage} rule "
                f"{owner.rule!r} selects, would act on {stages.get(owner.stage).replaces_grad}; a parameter is "
                f"{owner.stage} or {other.stage}, not both: use stage {_after(owner.stage)} (after it) or "
                "leave the parameter out"
            )


def _passes(targets: list[Any]) -> None:
    watched = next((t for t in targets if t.kind == "module" and stages.get(t.stage).sees_each_pass), None)
    if watched is None:
        return
    for name in dict.fromkeys(t.stage for t in targets):
        found = stages.stage_class(name).several_passes(targets)
        if found is not None:
            rule, how = found
            raise ValueError(
                f"hooks.{watched.rule}: a {watched.stage}-stage modules rule ({watched.key!r}) does not combine "
                f"with {rule.stage} rule {rule.rule!r}, {how}, so the output's hook would see each task's "
                f"gradient in turn; use a params rule (a {_after(watched.stage)} one sees the combined gradient)"
            )


def _own_backwards(targets: list[Any]) -> None:
    first = {}  # stage -> its first target, in stage order
    for t in sorted(targets, key=lambda t: stages.order(t.stage)):
        first.setdefault(t.stage, t)
    present = [(stages.get(name), t) for name, t in first.items()]
    for i, (a, ta) in enumerate(present):
        for b, tb in present[i + 1 :]:
            if a.runs_backward and b.runs_backward:
                refused, by, why = ta, tb, a.runs_backward
            elif a.counts_examples and b.runs_backward:  # a second pass after it: counted twice
                refused, by, why = ta, tb, a.counts_examples
            elif a.runs_backward and b.counts_examples:  # passes of its own before it: nothing to follow
                refused, by, why = tb, ta, f"{a.runs_backward}, which the {b.name} stage cannot follow"
            else:
                continue
            raise ValueError(
                f"hooks.{refused.rule}: a {refused.stage} rule does not combine with {by.stage} rule "
                f"{by.rule!r} ({why}); use one of them"
            )
