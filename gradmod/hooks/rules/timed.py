"""The rules that change with the step clock: scheduled arguments and ``active`` windows.

A scheduled argument's value is a host function of ``t`` (``gradmod.hooks.schedules``),
so it is evaluated on the host at the step boundary (``HookSet.after_backward``) and,
when it changed, the transform is rebuilt with the new value: an element-wise function
is replaced, and an object (a group, per_sample or per_loss transform) takes the
attributes the new value changes, keeping its state (running statistics, counters). No
device sync, no op per step; every micro-batch of one optimizer step sees one value.

A transform object with an ``at_step(t)`` method is told each new ``t`` (``noise``'s
annealing), so it counts optimizer steps, and a resume restores it from the clock alone.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping

from gradmod.hooks import registry as R
from gradmod.hooks.schedules import (
    Active,
    Clock,
    Length,
    Schedule,
    parse_active,
    parse_schedule,
    scheduled_paths,
    value_at,
    with_values,
)

_PLAIN = (int, float, bool, str, type(None))


def split_schedules(
    args: Mapping[str, Any], where: str, length: Length
) -> tuple[Mapping[str, Any], dict[str, Schedule]]:
    """A transform's arguments with each scheduled one (or entry of a mapping or list
    argument) at its first value, and the schedules by path (``arg``, ``arg.key``;
    ``where``: ``hooks.RULE.transforms.I``); one line if bad."""
    schedules = {path: parse_schedule(v, f"{where}.{path}") for path, v in scheduled_paths(args).items()}
    if not schedules:
        return args, {}
    for k, s in schedules.items():
        s.check(length, f"{where}.{k}")
    return with_values(args, {k: s.value(0, length) for k, s in schedules.items()}), schedules


def check_range(
    name: str, args: Mapping[str, Any], schedules: Mapping[str, Schedule], length: Length, stage: str
) -> None:
    """Build the transform with its values at the end of the run too (and each schedule's
    far end), so that a value its factory refuses (a max_norm ramped to 0) fails at attach."""
    ends: dict[str, float] = {}
    for k, s in schedules.items():
        if s.kind in ("linear", "cosine", "dann") and s.end is not None:
            ends[k] = s.end if s.kind != "dann" else s.value(10**12, length)
        elif length.total_steps is not None:
            ends[k] = s.value(length.total_steps, length)
    if ends:
        R.build_parsed(name, with_values(args, ends), stage)


def rule_window(rule: str, spec: Mapping[str, Any], length: Length) -> Active | None:
    """The rule's ``active`` window, checked against the run's length; None: always."""
    if spec.get("active") is None:
        return None
    window = parse_active(spec["active"], f"hooks.{rule}.active")
    window.check(length, f"hooks.{rule}.active")
    return window


def retune(step: R.BuiltTransform, values: Mapping[str, float]) -> None:
    """Give ``step`` new argument values in place. An element-wise function is rebuilt; an
    object takes the plain attributes whose value the new arguments change, so its state
    (tensors, counters, records) stays where it is."""
    e = R.entry(step.name)
    make = e.factory if step.at is None else e.at_stage[step.at]
    args = with_values(step.args, values)
    fresh = make(**args)
    if step.kind == "elementwise" and step.at is None:
        object.__setattr__(step, "fn", fresh)
        step.__dict__.pop("inplace", None)  # the cached foreach form holds the old value
    else:
        before = vars(make(**step.args))
        for name, value in vars(fresh).items():
            if _plain(value) and before.get(name) != value:
                setattr(step.fn, name, value)
    object.__setattr__(step, "args", args)


class Timed:
    """The step clock and what follows it: the scheduled steps (one entry per distinct
    ``BuiltTransform``) and the rules' windows. ``at(t)`` brings them all to ``t``."""

    def __init__(self, targets: Iterable[Any], windows: Mapping[str, Active], length: Length):
        self.clock = Clock(length)
        self.windows = dict(windows)
        self.scheduled: list[tuple[str, R.BuiltTransform]] = []  # (rule/transform, step)
        self.clocked: list[Any] = []  # objects with at_step(t)
        seen: set[int] = set()
        for t in targets:
            for s in t.steps:
                if id(s) in seen:
                    continue
                seen.add(id(s))
                if s.schedules:
                    self.scheduled.append((f"{t.rule}/{s.name}", s))
                if callable(getattr(s.fn, "at_step", None)):
                    self.clocked.append(s)
        self.inactive: set[str] = set()  # rules outside their window now
        self.at(0)

    def __bool__(self) -> bool:
        return bool(self.scheduled or self.windows or self.clocked)

    @property
    def t(self) -> int:
        return self.clock.t

    def at(self, t: int) -> None:
        """Bring every scheduled value, window and clocked transform to ``t`` completed steps."""
        self.clock.t = t
        length = self.clock.length
        for _, step in self.scheduled:
            new = {k: s.value(t, length) for k, s in step.schedules.items()}
            if any(not _same(value_at(step.args, k), v) for k, v in new.items()):
                retune(step, new)
        for step in self.clocked:
            step.fn.at_step(t)
        self.inactive = {rule for rule, w in self.windows.items() if not w.contains(t, length)}

    def advance(self) -> None:
        """One optimizer step completed."""
        self.at(self.clock.t + 1)

    def stats(self) -> dict[str, dict[str, Any]]:
        """For a log point, what the last completed step used (values are pure functions of
        ``t``): ``{"rule/transform.arg": {"value": v}}``, and each window as
        ``{"rule/active": {"value": 1 or 0}}``. Nothing when no step completed since the
        last read (a read at the end of an epoch right after a log point)."""
        if self.clock.t == self.clock.read or not (self.scheduled or self.windows):
            return {}
        self.clock.read = self.clock.t
        t, length = self.clock.t - 1, self.clock.length
        out = {
            f"{key}.{k}": {"value": s.value(t, length)}
            for key, step in self.scheduled
            for k, s in step.schedules.items()
        }
        out.update({f"{rule}/active": {"value": float(w.contains(t, length))} for rule, w in self.windows.items()})
        return out


def _plain(value: Any) -> bool:
    """A number, string or None, or a list or dict of them (``fixed``'s weights): an
    attribute an argument sets, not a state."""
    if isinstance(value, (list, tuple)):
        return all(map(_plain, value))
    if isinstance(value, dict):
        return all(map(_plain, value.values()))
    return isinstance(value, _PLAIN)


def _same(a: Any, b: float) -> bool:
    return isinstance(a, (int, float)) and (a == b or (math.isnan(a) and math.isnan(b)))
