"""Hook rules: what a rule selects (tensors by name) and the transforms each one gets.

A rule is ``{"params": glob(s), "exclude": glob(s), "transforms": [...], "stage": ...}``
or ``{"modules": glob(s), ...}``; a key set to null is unset. Names are verified, not
trusted: a pattern that matches nothing is an error listing close names (besides globs, the
selectors of ``gradmod.hooks.rules.globs``: ``@last_layer``, ``@norms``, ``@matrices``, ...). A rule's stage
is its own, else the default, unless a transform's kind implies one
(``gradmod.hooks.stages``); the transforms must all run at that stage.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping

from torch import nn

from gradmod.hooks import registry as R
from gradmod.hooks import stages
from gradmod.hooks.rules import shared as shared_params
from gradmod.hooks.rules.globs import ParamKind, param_kinds, select
from gradmod.hooks.rules.switched import switched_off
from gradmod.hooks.rules.syntax import parse_spec, transform_list
from gradmod.hooks.rules.timed import check_range, rule_window, split_schedules
from gradmod.hooks.schedules import Active, Length

STAGE_NAMES = stages.names()  # the stages a rule may name, in order
DEFAULT_STAGES = stages.default_names()  # a rule's stage when it sets none; the others are set per rule
NAMED = DEFAULT_STAGES + tuple(s for s in STAGE_NAMES if s not in DEFAULT_STAGES)  # as messages list them
RULE_KEYS = ("params", "modules", "exclude", "transforms", "stage", "rows", "active")


@dataclass
class Target:
    """One selected tensor and the transforms (in order) a rule applies to it."""

    rule: str
    kind: str  # "param" | "module"
    name: str
    stage: str
    steps: list[R.BuiltTransform]
    rows: str | None = None  # a per_loss modules rule's ``rows``; None: examples
    active: Active | None = None  # the rule's window; None: every step

    @property
    def key(self) -> str:
        """The tensor's name in plans and statistics: a module's output is ``name:output``, its
        input (where the stage reads inputs) ``name:input``, the model's ``@input``."""
        if self.kind == "param":
            return self.name
        if stages.get(self.stage).model_input:
            return f"{self.name}:input" if self.name else "@input"
        return f"{self.name}:output"


def build_targets(
    model: nn.Module,
    rules: Mapping[str, Mapping[str, Any]] | None,
    stage: str = stages.DEFAULT,
    length: Length | None = None,
) -> list[Target]:
    """Check the rules against the model and return what to attach, in config order.
    ``length``: what turns schedules' and windows' epochs and fractions into steps."""
    if not isinstance(rules, Mapping) and rules is not None:
        raise ValueError(f"hooks must be a mapping of rule name to rule, got {type(rules).__name__}")
    params = [n for n, p in model.named_parameters() if p.requires_grad or switched_off(p)]
    every = [n for n, _ in model.named_parameters()]  # frozen ones too: a follows_frozen stage's rule covers them
    modules = [n for n, _ in model.named_modules()]  # "" (the model itself) only as @input
    kinds = param_kinds(model)  # what the selectors (@norms, @matrices, ...) read
    found = shared_params.found(model)  # what @shared stands for
    targets: list[Target] = []
    for rule, spec in (rules or {}).items():
        if not isinstance(spec, Mapping):
            raise ValueError(f"hooks.{rule}: a rule must be a mapping with params or modules and transforms")
        spec = {k: v for k, v in spec.items() if v is not None}  # a null key is an unset one
        unknown = [k for k in spec if k not in RULE_KEYS]
        if unknown:
            raise ValueError(
                f"hooks.{rule}: unknown key(s) {', '.join(map(str, unknown))}; allowed: {', '.join(RULE_KEYS)}"
            )
        if ("params" in spec) == ("modules" in spec):
            raise ValueError(f"hooks.{rule}: give exactly one of 'params' or 'modules'")
        targets.extend(_rule_targets(rule, spec, (params, every), modules, stage, length or Length(), kinds, found))
    _check_observer_keys(targets)
    return targets


def _kind(name: str) -> str | None:
    """The registered kind of ``name``; None for an unknown name (building it says so)."""
    try:
        return R.entry(name).kind
    except ValueError:
        return None


def _rule_stage(rule: str, spec: Mapping[str, Any], kind: str, names: list[str], default: str) -> str:
    """The rule's stage: the one a transform's kind implies (a group transform runs fused,
    where all the rule's gradients are there at once), else its own, else the default
    (``modules`` rules: the hook stage)."""
    asked = spec.get("stage")
    rule_stage = asked or default
    if rule_stage not in STAGE_NAMES:
        raise ValueError(f"hooks.{rule}.stage: {rule_stage!r} is not a stage; allowed: {', '.join(NAMED)}")
    forced = sorted(
        ((stages.implied_by(k), n) for n in names if (k := _kind(n)) and stages.implied_by(k)),
        key=lambda sn: stages.order(sn[0].name),
    )
    if forced:
        stage, by = forced[0]
        _check_forced(rule, asked, kind, stage, by)
    elif kind == "param":
        stage = stages.get(rule_stage)
    elif asked in (None, stages.DEFAULT):
        return stages.DEFAULT  # modules rules run as hooks, whatever the default
    else:
        stage = stages.get(asked)
    if kind == "module" and not stage.modules:
        raise ValueError(f"hooks.{rule}.stage: {stage.name!r} needs params ({stage.sees}); modules rules run as hooks")
    _check_accepted(rule, stage.name, names)
    return stage.name


def _check_forced(rule: str, asked: str | None, kind: str, stage: stages.StageFacts, by: str) -> None:
    """A transform whose kind implies ``stage``: the rule may not ask for another, nor be a modules rule."""
    what = f"{_kind(by)} transform {by!r}"
    if kind == "module" and not stage.modules:
        raise ValueError(f"hooks.{rule}: {what} needs params ({stage.sees}), not modules")
    if asked is not None and asked != stage.name:
        raise ValueError(f"hooks.{rule}.stage: {what} acts on {stage.sees}; it runs at stage {stage.name!r} only")


def _check_accepted(rule: str, stage: str, names: list[str]) -> None:
    """Every transform of the rule runs at its stage; one that needs the whole rule, once."""
    other = [n for n in names if _kind(n) is not None and not R.runs_at(n, stage)]
    if other:
        raise ValueError(
            f"hooks.{rule}.transforms: {other[0]!r} cannot run at stage {stage!r}; allowed there: "
            f"{', '.join(R.accepted_at(stage))} (put the others in a rule of their own)"
        )


def _check_rule(rule: str, spec: Mapping[str, Any], kind: str, stage: str, names: list[str]) -> None:
    """The rule's shape at its stage: no key another stage's rules hold, and the stage's own check."""
    for key, refusal in (kw for s in stages.STAGES if s.name != stage for kw in s.rule_keys):
        if key in spec:
            raise ValueError(f"hooks.{rule}.{key}: {refusal}")
    stages.stage_class(stage).check_rule(rule, kind, names, spec)


def _shared(step: R.BuiltTransform) -> bool:
    """A step that sees all of a rule's tensors together: one instance for the rule."""
    return step.kind != "elementwise" or step.at is not None


def _parsed(rule: str, spec: Mapping[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The rule's transforms, each read once: (name, arguments)."""
    transforms = transform_list(spec.get("transforms"))
    if not transforms:
        raise ValueError(f"hooks.{rule}.transforms: give at least one of {', '.join(R.names())}")
    try:
        return [parse_spec(t) for t in transforms]
    except ValueError as e:
        raise ValueError(f"hooks.{rule}.transforms: {e}") from None


def _rule_targets(
    rule: str,
    spec: Mapping[str, Any],
    named: tuple[list[str], list[str]],
    modules: list[str],
    default_stage: str,
    length: Length,
    kinds: Mapping[str, ParamKind] | None = None,
    every_task: list[str] | None = None,
) -> list[Target]:
    """``named``: the trainable parameters' names, and every parameter's."""
    params, every = named
    kind = "param" if "params" in spec else "module"
    parsed = _parsed(rule, spec)
    stage = _rule_stage(rule, spec, kind, [n for n, _ in parsed], default_stage)
    _check_rule(rule, spec, kind, stage, [n for n, _ in parsed])
    names = select(
        rule,
        spec,
        params if kind == "param" else modules,
        "parameter (see model.named_parameters())" if kind == "param" else "module (see model.named_modules())",
        kinds,
        shared=every_task,  # what @shared stands for
    )
    if stages.get(stage).follows_frozen and kind == "param":
        names += _frozen_too(rule, spec, params, every, kinds)
    window = rule_window(rule, spec, length)
    _check_at_stage(rule, stage, "" in names, window is not None)
    timed = [(n, *split_schedules(a, f"hooks.{rule}.transforms.{i}", length)) for i, (n, a) in enumerate(parsed)]
    shared: dict[int, R.BuiltTransform] = {}  # a group or per-example step: one instance for all the rule's tensors
    targets = []
    for name in names:
        try:  # per tensor: observers and stateful transforms keep their own state
            steps = [
                shared.get(i) or _build(n, first, sched, stage, length) for i, (n, first, sched) in enumerate(timed)
            ]
        except ValueError as e:
            raise ValueError(f"hooks.{rule}.transforms: {e}") from None
        shared.update((i, st) for i, st in enumerate(steps) if _shared(st))
        targets.append(Target(rule, kind, name, stage, _label_observers(steps, stage), spec.get("rows"), window))
    return targets


def _check_at_stage(rule: str, stage: str, model_input: bool, windowed: bool) -> None:
    """What only some stages take: the model's input (@input), a window (``active``)."""
    if model_input and not stages.get(stage).model_input:
        raise ValueError(
            f"hooks.{rule}.modules: @input (the model's input) is for a "
            f"{' or '.join(s.name for s in stages.STAGES if s.model_input)} rule; name modules by their globs"
        )
    if windowed and not stages.get(stage).windows:
        *some, last = (s.name for s in stages.STAGES if s.windows)
        allowed = f"{', '.join(some)} or {last}" if some else last
        raise ValueError(
            f"hooks.{rule}.active: a window is for rules at stage {allowed}; a {stage} rule acts every step"
        )


def _frozen_too(
    rule: str, spec: Mapping[str, Any], params: list[str], every: list[str], kinds: Mapping[str, ParamKind] | None
) -> list[str]:
    """The parameters frozen at attach that a per_sample rule's globs match, after its own:
    the stage follows them too, so that one unfrozen later is clipped (and noised) with the rule."""
    if len(every) == len(params):
        return []
    trainable = set(params)
    try:
        wide = select(rule, spec, every, "parameter", kinds)
    except ValueError:  # its exclude removes every frozen one it names
        return []
    return [n for n in wide if n not in trainable]


def _build(
    name: str, args: Mapping[str, Any], schedules: dict[str, Any], stage: str, length: Length
) -> R.BuiltTransform:
    """One step, with its schedules (its arguments at their first value)."""
    step = R.build_parsed(name, args, stage)
    if not schedules:
        return step
    if step.observer:
        raise ValueError(f"{step.name!r} observes: its arguments cannot be scheduled")
    check_range(name, args, schedules, length, stage)
    return replace(step, fn=step.fn, schedules=schedules)


def _label_observers(steps: list[R.BuiltTransform], stage: str) -> list[R.BuiltTransform]:
    """``log`` first in a chain of several steps is ``pre``, last is ``post`` (an explicit
    ``label`` wins); a chain that starts and ends with ``log`` pairs the two, so ``post``
    reports the fraction of elements the transforms between them changed."""
    if len(steps) < 2:
        return steps
    out = list(steps)
    for i, label in ((0, "pre"), (len(out) - 1, "post")):
        step = out[i]
        if step.observer and step.fn.label is None:
            out[i] = R.build_parsed(step.name, {**step.args, "label": label}, stage)
    if out[0].observer and out[-1].observer:
        first, last = out[0].fn, out[-1].fn
        last.pre = first
        # The fused stage transforms .grad in place, so pre must keep a copy.
        first.keep = "clone" if stages.get(stage).in_place else "ref"
    return out


def observer_key(target: Target, obs: Any) -> str:
    """The key of an observer's statistics: ``tensor`` or ``tensor/label``."""
    return f"{target.key}/{obs.label}" if obs.label else target.key


def _check_observer_keys(targets: list[Target]) -> None:
    seen: dict[str, str] = {}
    for key, rule, _ in group_steps(targets):
        if key in seen:
            raise ValueError(
                f"hooks.{rule}: transform {key.partition('/')[2]!r} appears twice in the rule; "
                "give it once (its statistics are keyed by rule and transform)"
            )
        seen[key] = rule
    for t in targets:
        for s in t.steps:
            if s.observer:
                key = observer_key(t, s.fn)
                if key in seen:
                    raise ValueError(
                        f"hooks.{t.rule}: its log of {key!r} has the same key as one in rule "
                        f"{seen[key]!r}; give one of them a distinct label, e.g. {{name: log, label: {t.rule}}}"
                    )
                seen[key] = t.rule


def load_rules(rules: Mapping[str, Any] | str | Path | list | tuple) -> dict[str, Any]:
    """Rules from a mapping, a hook config file (a path, or a shipped file's name such as
    ``"clip"``), or a list of these merged by rule name (a name given twice is an error)."""
    if isinstance(rules, (str, Path, list, tuple)):
        from gradmod.hooks.rules.sources import read_rules

        rules = read_rules(rules)
    if not isinstance(rules, Mapping):
        raise ValueError(
            f"rules must be a mapping of rule name to rule or a hook config file, got {type(rules).__name__}"
        )
    return dict(rules)


def group_steps(targets: list[Target]) -> list[tuple[str, str, R.BuiltTransform]]:
    """(``rule/transform``, rule, step) of every group transform, once each, in config order."""
    out, seen = [], set()
    for t in targets:
        for s in t.steps:
            if s.kind == "group" and id(s) not in seen:
                seen.add(id(s))
                out.append((f"{t.rule}/{s.name}", t.rule, s))
    return out


def in_order(targets: list[Target]) -> list[Target]:
    """The targets in application order: by stage (``stages.STAGES``), each in config order."""
    return [t for stage in STAGE_NAMES for t in targets if t.stage == stage]


def chains_of(targets: list[Target]) -> list[tuple[str, list[str]]]:
    """(tensor name, transform names) in application order; module outputs as ``name:output``."""
    out: dict[str, list[str]] = {}
    for t in in_order(targets):
        out.setdefault(t.key, []).extend(s.name for s in t.steps)
    return list(out.items())


def describe(targets: list[Target]) -> list[dict[str, Any]]:
    """The plan with rules, stages and arguments, for printing and saving (application order)."""
    return [
        {
            "tensor": t.key,
            "rule": t.rule,
            "stage": t.stage,
            "transforms": [str(s) for s in t.steps],
            **({"active": str(t.active)} if t.active is not None else {}),
        }
        for t in in_order(targets)
    ]


def format_plan(rows: list[dict[str, Any]]) -> str:
    """``describe``'s rows as text, one line per tensor and rule."""
    if not rows:
        return "hook plan: no rules"
    width = max(len(d["tensor"]) for d in rows)
    stage_width = max(5, *(len(d["stage"]) for d in rows))
    lines = [
        f"  {d['tensor']:<{width}}  {d['stage']:<{stage_width}}  {d['rule']}: {' -> '.join(d['transforms'])}"
        + (f"  (active steps {d['active']})" if "active" in d else "")
        for d in rows
    ]
    return "hook plan:\n" + "\n".join(lines)


def check_options(
    stage: str, loss_reduction: str, batch_dim: int | None, total_steps: int | None, steps_per_epoch: int | None
) -> None:
    """``attach``'s own arguments, each refused in one line."""
    for name, n in (("total_steps", total_steps), ("steps_per_epoch", steps_per_epoch)):
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"attach: {name}={n!r} must be an int >= 1 (optimizer steps), or None")
    if stage not in DEFAULT_STAGES:
        hint = ""
        if stage in stages.names():  # a stage of its own: a rule sets it, or a transform's kind implies it
            implied = [n for kind in (stages.get(stage).implied_by,) if kind for n in R.names(kind)]
            hint = f"; {stage} is set per rule" + (f" (or implied by {', '.join(implied[:3])})" if implied else "")
        raise ValueError(f"stage {stage!r} is not a default stage; allowed: {', '.join(DEFAULT_STAGES)}{hint}")
    if loss_reduction not in ("mean", "sum"):
        raise ValueError(f"loss_reduction={loss_reduction!r}; allowed: mean, sum")
    if batch_dim is not None and (isinstance(batch_dim, bool) or not isinstance(batch_dim, int) or batch_dim < 0):
        raise ValueError(f"batch_dim={batch_dim!r}; allowed: an int >= 0 (the inputs' batch dimension)")
