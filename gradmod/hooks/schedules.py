"""Values that change over training: schedules, windows and the step clock (no torch).

A transform's numeric argument may be a mapping in place of the number::

    factor: {schedule: dann, start: 0.0, end: -1.0}            # gamma: 10
    max_norm: {schedule: linear, start: 5.0, end: 1.0, until: 500ba}

Its value is a pure function of ``t``, the number of optimizer steps completed before the
one being computed (0 for the first; skipped steps count), and of the run's length (steps
per epoch, total steps): every micro-batch of one step sees the same value, and a resume
needs nothing but ``t``. Times are written ``500ba`` (optimizer steps; a plain number is
steps too), ``2ep`` (epochs) or ``0.5dur`` (fraction of the run). With ``from`` (default
0) and ``until`` (default the end of the run), ``p = clamp((t - from) / (until - from), 0, 1)``:

* ``constant``: start
* ``linear``: start + (end - start) p
* ``cosine``: end + (start - end) (1 + cos(pi p)) / 2
* ``dann``: start + (end - start) (2 / (1 + exp(-gamma p)) - 1)   (gamma default 10)
* ``exp``: start * gamma ** floor((t - from) / every) for t >= from, else start (every default 1ba)
* ``step``: start * gamma ** (the milestones t has reached)   (gamma default 0.1)

A window ``active: {from: 2ep, until: 5ep}`` holds for ``from <= t < until`` (half-open,
and a function of ``t`` alone, so a resume in the middle of a window is inside it).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

UNITS = {"ba": "optimizer steps", "ep": "epochs", "dur": "fractions of the run"}
KINDS = ("constant", "linear", "cosine", "exp", "step", "dann")
# The keys each schedule takes besides ``schedule`` (start is required by all).
KEYS: dict[str, tuple[str, ...]] = {
    "constant": ("start",),
    "linear": ("start", "end", "from", "until"),
    "cosine": ("start", "end", "from", "until"),
    "dann": ("start", "end", "gamma", "from", "until"),
    "exp": ("start", "gamma", "every", "from"),
    "step": ("start", "gamma", "milestones"),
}
_REQUIRED = {"linear": ("end",), "cosine": ("end",), "dann": ("end",), "exp": ("gamma",), "step": ("milestones",)}
_TIME = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(ba|ep|dur)\s*$")


@dataclass(frozen=True)
class Length:
    """What converts ``ep`` and ``dur`` into steps: None where the run does not say."""

    steps_per_epoch: int | None = None
    total_steps: int | None = None


@dataclass(frozen=True)
class Time:
    """A point or span of training time: ``value`` in ``unit`` (ba, ep or dur)."""

    value: float
    unit: str = "ba"

    def __str__(self) -> str:
        return f"{self.value:g}{self.unit}"

    def needs(self) -> str | None:
        """The run length this time needs to become steps (None for steps)."""
        return {"ba": None, "ep": "steps_per_epoch", "dur": "total_steps"}[self.unit]

    def steps(self, length: Length) -> float:
        """This time in optimizer steps (fractional where the units make it so)."""
        if self.unit == "ba":
            return self.value
        n = length.steps_per_epoch if self.unit == "ep" else length.total_steps
        if n is None:  # checked at attach; reaching here is a bug
            raise AssertionError(f"{self} needs {self.needs()}")
        return self.value * n


def parse_time(value: Any, where: str) -> Time:
    """``500ba``, ``2ep``, ``0.5dur`` or a plain number of steps; >= 0. One line otherwise."""
    if isinstance(value, bool):
        raise ValueError(f"{where}={value!r} must be a time such as 500ba, 2ep or 0.5dur")
    if isinstance(value, (int, float)):
        t = Time(float(value), "ba")
    elif isinstance(value, str) and (m := _TIME.match(value)):
        t = Time(float(m.group(1)), m.group(2))
    else:
        raise ValueError(
            f"{where}={value!r} must be a time: a number of steps or one with a unit "
            f"({', '.join(f'{u}: {w}' for u, w in UNITS.items())}), e.g. 500ba, 2ep, 0.5dur"
        )
    if not (math.isfinite(t.value) and t.value >= 0):
        raise ValueError(f"{where}={value!r} must be a finite time >= 0")
    return t


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{where}={value!r} must be a finite number")
    return float(value)


def is_schedule(value: Any) -> bool:
    """A config value that is a schedule (a mapping with a ``schedule`` key)."""
    return isinstance(value, Mapping) and "schedule" in value


def scheduled_paths(args: Mapping[str, Any]) -> dict[str, Any]:
    """Each schedule among a transform's arguments by its path: ``arg``, or ``arg.key`` for
    an entry of a mapping or list argument (``weights: {aux: {schedule: ...}}``)."""
    out = {}
    for k, v in args.items():
        if is_schedule(v):
            out[str(k)] = v
        elif isinstance(v, Mapping) or (isinstance(v, Sequence) and not isinstance(v, str)):
            inner = v.items() if isinstance(v, Mapping) else enumerate(v)
            out.update({f"{k}.{j}": x for j, x in inner if is_schedule(x)})
    return out


def value_at(args: Mapping[str, Any], path: str) -> Any:
    """The value at ``path`` (``scheduled_paths``); None where there is none."""
    k, _, j = path.partition(".")
    v = args.get(k)
    if not j or v is None:
        return v
    if isinstance(v, Mapping):
        return next((x for key, x in v.items() if str(key) == j), None)
    return v[int(j)]


def with_values(args: Mapping[str, Any], values: Mapping[str, Any]) -> dict[str, Any]:
    """``args`` with each of ``values`` at its path (``scheduled_paths``), containers copied."""
    out = dict(args)
    for path, value in values.items():
        k, _, j = path.partition(".")
        if not j:
            out[k] = value
        elif isinstance(out[k], Mapping):
            out[k] = {key: value if str(key) == j else x for key, x in out[k].items()}
        else:
            out[k] = [value if i == int(j) else x for i, x in enumerate(out[k])]
    return out


@dataclass(frozen=True)
class Schedule:
    """One argument's schedule, as the config gives it (times not yet in steps)."""

    kind: str
    start: float
    end: float | None = None
    gamma: float | None = None
    every: Time = field(default_factory=lambda: Time(1.0))
    milestones: tuple[Time, ...] = ()
    begin: Time = field(default_factory=lambda: Time(0.0))  # the config's ``from``
    until: Time | None = None  # None: the end of the run

    def times(self) -> list[tuple[str, Time | None]]:
        """(key, time) of every time the value depends on; ``until`` None means the run's end."""
        out: list[tuple[str, Time | None]] = []
        if self.kind in ("linear", "cosine", "dann"):
            out += [("from", self.begin), ("until", self.until)]
        elif self.kind == "exp":
            out += [("from", self.begin), ("every", self.every)]
        elif self.kind == "step":
            out += [(f"milestones.{i}", m) for i, m in enumerate(self.milestones)]
        return out

    def check(self, length: Length, where: str) -> None:
        """Refuse, in one line, a schedule whose units need a length the run does not know,
        or whose ``until`` is not after its ``from``."""
        for key, t in self.times():
            need = "total_steps" if t is None else t.needs()
            if need is not None and getattr(length, need) is None:
                what = "the end of the run (until unset)" if t is None else f"{key}={t}"
                raise ValueError(
                    f"{where}: {what} needs {need}, which this run does not know; give "
                    f"attach(..., {need}=N), or times in ba (optimizer steps)"
                )
        if self.kind in ("linear", "cosine", "dann"):
            lo, hi = self.begin.steps(length), self._until(length)
            if hi <= lo:
                raise ValueError(f"{where}: until ({hi:g} steps) must be after from ({lo:g} steps)")
        bad = [t for t in self._extremes(length) if not self._finite(t, length)]
        if bad:
            lo, hi = -1, bad[0]  # the first step out of range: the kinds only grow past it
            while hi - lo > 1:
                lo, hi = (lo, (lo + hi) // 2) if not self._finite((lo + hi) // 2, length) else ((lo + hi) // 2, hi)
            try:
                self.value(hi, length)
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from None

    def _finite(self, t: int, length: Length) -> bool:
        try:
            return math.isfinite(self._value(t, length))
        except OverflowError:
            return False

    def _extremes(self, length: Length) -> list[int]:
        """The steps at which the value is largest in size: each kind is monotone between
        them (the clock reaches ``total_steps`` after the last step)."""
        last = length.total_steps
        if self.kind == "step":
            reached = [m.steps(length) for m in self.milestones]
            return [math.ceil(max(reached)) if last is None else min(last, math.ceil(max(reached)))] if reached else []
        if self.kind in ("linear", "cosine", "dann"):
            return [0, math.ceil(self._until(length))]
        return [0] if last is None else [0, last]

    def _until(self, length: Length) -> float:
        if self.until is None:
            return float(length.total_steps)  # type: ignore[arg-type]
        return self.until.steps(length)

    def value(self, t: int, length: Length) -> float:
        """The value for the optimizer step that follows ``t`` completed steps; a ValueError
        where it is not a finite float (``exp`` grown past 1.8e308)."""
        try:
            value = self._value(t, length)
        except OverflowError:  # a power too large (exp, step): its sign is the start's
            value = math.copysign(math.inf, self.start)
        if not math.isfinite(value):
            raise ValueError(f"{self} is {value:g} at step {t}, beyond a float's range; keep it finite over the run")
        return value

    def _value(self, t: int, length: Length) -> float:
        if self.kind == "constant":
            return self.start
        if self.kind == "step":
            passed = sum(1 for m in self.milestones if t >= m.steps(length))
            return self.start * self.gamma**passed  # type: ignore[operator]
        begin = self.begin.steps(length)
        if self.kind == "exp":
            k = math.floor((t - begin) / self.every.steps(length)) if t >= begin else 0
            return self.start * self.gamma**k  # type: ignore[operator]
        span = self._until(length) - begin
        p = min(max((t - begin) / span, 0.0), 1.0)
        end: float = self.end  # type: ignore[assignment]
        if self.kind == "linear":
            return self.start + (end - self.start) * p
        if self.kind == "cosine":
            return end + (self.start - end) * (1 + math.cos(math.pi * p)) / 2
        return self.start + (end - self.start) * (2 / (1 + math.exp(-self.gamma * p)) - 1)  # type: ignore[operator]

    def __str__(self) -> str:
        parts = [f"start={self.start:g}"]
        if self.end is not None:
            parts.append(f"end={self.end:g}")
        if self.gamma is not None:
            parts.append(f"gamma={self.gamma:g}")
        if self.kind == "exp":
            parts.append(f"every={self.every}")
        if self.milestones:
            parts.append(f"milestones=[{', '.join(map(str, self.milestones))}]")
        if self.kind in ("linear", "cosine", "dann", "exp") and self.begin.value:
            parts.append(f"from={self.begin}")
        if self.kind in ("linear", "cosine", "dann"):
            parts.append(f"until={self.until or 'end'}")
        return f"{self.kind}({', '.join(parts)})"


def parse_schedule(spec: Mapping[str, Any], where: str) -> Schedule:
    """A schedule from its config mapping; a one-line ValueError naming ``where`` otherwise."""
    kind = spec.get("schedule")
    if kind not in KINDS:
        raise ValueError(f"{where}.schedule={kind!r} is not a schedule; allowed: {', '.join(KINDS)}")
    allowed = KEYS[kind]
    unknown = [str(k) for k in spec if k != "schedule" and k not in allowed]
    if unknown:
        raise ValueError(
            f"{where}: schedule {kind!r} got unknown key(s) {', '.join(unknown)}; allowed: {', '.join(allowed)}"
        )
    missing = [k for k in ("start", *_REQUIRED.get(kind, ())) if spec.get(k) is None]
    if missing:
        raise ValueError(f"{where}: schedule {kind!r} needs {', '.join(missing)}")
    gamma_default = {"dann": 10.0, "step": 0.1}.get(kind)
    gamma = spec.get("gamma", gamma_default)
    args: dict[str, Any] = {
        "kind": kind,
        "start": _number(spec["start"], f"{where}.start"),
        "end": None if spec.get("end") is None else _number(spec["end"], f"{where}.end"),
        "gamma": None if gamma is None else _number(gamma, f"{where}.gamma"),
    }
    if kind == "exp" and args["gamma"] <= 0:
        raise ValueError(f"{where}.gamma={gamma!r} must be > 0 (the factor per period)")
    if "from" in spec:
        args["begin"] = parse_time(spec["from"], f"{where}.from")
    if spec.get("until") is not None:
        args["until"] = parse_time(spec["until"], f"{where}.until")
    if "every" in spec:
        every = spec["every"]
        if isinstance(every, (int, float)) and not isinstance(every, bool) and every < 0:
            raise ValueError(f"{where}.every={every!r} must be > 0 (a period such as 100ba or 1ep)")
        args["every"] = parse_time(every, f"{where}.every")
        if args["every"].value <= 0:
            raise ValueError(f"{where}.every={every!r} must be > 0 (a period such as 100ba or 1ep)")
    if kind == "step":
        milestones = spec["milestones"]
        if isinstance(milestones, (str, bytes)) or not hasattr(milestones, "__iter__"):
            raise ValueError(f"{where}.milestones={milestones!r} must be a list of times, e.g. [1ep, 3ep]")
        args["milestones"] = tuple(parse_time(m, f"{where}.milestones.{i}") for i, m in enumerate(milestones))
    if args.get("begin") and args.get("until") and args["begin"].unit == args["until"].unit:
        if args["until"].value <= args["begin"].value:
            raise ValueError(f"{where}: until={args['until']} must be after from={args['begin']}")
    return Schedule(**args)


@dataclass(frozen=True)
class Active:
    """A rule's window ``[from, until)`` in training time; ``until`` None: to the end."""

    begin: Time = field(default_factory=lambda: Time(0.0))
    until: Time | None = None

    def check(self, length: Length, where: str) -> None:
        for key, t in (("from", self.begin), ("until", self.until)):
            need = None if t is None else t.needs()
            if need is not None and getattr(length, need) is None:
                raise ValueError(
                    f"{where}.{key}={t} needs {need}, which this run does not know; give "
                    f"attach(..., {need}=N), or times in ba (optimizer steps)"
                )
        if self.until is not None and self.until.steps(length) <= self.begin.steps(length):
            raise ValueError(f"{where}: until={self.until} must be after from={self.begin}")

    def contains(self, t: int, length: Length) -> bool:
        """Whether the step after ``t`` completed steps lies inside the window."""
        if t < self.begin.steps(length):
            return False
        return self.until is None or t < self.until.steps(length)

    def __str__(self) -> str:
        return f"[{self.begin}, {self.until or 'end'})"


def parse_active(spec: Any, where: str) -> Active:
    """``{from: 2ep, until: 5ep}`` (either may be left out); one line otherwise."""
    if not isinstance(spec, Mapping):
        raise ValueError(f"{where}={spec!r} must be a mapping such as {{from: 2ep, until: 5ep}}")
    unknown = [str(k) for k in spec if k not in ("from", "until")]
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(unknown)}; allowed: from, until")
    begin = parse_time(spec["from"], f"{where}.from") if spec.get("from") is not None else Time(0.0)
    until = parse_time(spec["until"], f"{where}.until") if spec.get("until") is not None else None
    if until is not None and until.unit == begin.unit and until.value <= begin.value:
        raise ValueError(f"{where}: until={until} must be after from={begin}")
    return Active(begin, until)


class Clock:
    """The step counter: ``t``, the optimizer steps completed, advanced once per step (by
    ``HookSet.after_backward``, or set from a trainer's global step), in checkpoints."""

    def __init__(self, length: Length | None = None):
        self.length = length or Length()
        self.t = 0
        self.read = 0  # t at the last log point that reported the values

    def state_dict(self) -> dict[str, int]:
        return {"t": self.t, "read": self.read}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.t, self.read = int(state["t"]), int(state.get("read", state["t"]))
