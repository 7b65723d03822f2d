"""Checks of the numeric arguments of transforms and per_loss methods, each a one-line
ValueError naming the bad one, raised when the rule is built.

Two kinds have bounds of their own, the same wherever they occur: an iteration count
(``count``: a whole number, at most ``MAX_COUNT`` where a step runs them all, so that a step
ends) and a step size or a coefficient of a step (``positive`` or ``in_range`` with ``high=
MAX_STEP``: finite, as an infinite one makes the weights or the parameters nan at the first
step, and not so large that the first step overflows).

A leaf: the transforms of every stage import it, and it imports nothing of gradmod.
"""

from __future__ import annotations

import math
from typing import Any

MAX_COUNT = 10_000  # iterations within one step: more, and a step runs for minutes (nash_mtl's 7 ms each)
MAX_STEP = 1e6  # a step size or a coefficient of one: larger, and a step overflows to inf, then nan
EXACT = 2**53  # whole numbers up to it are exact in float64: a larger float is no count anyone meant
LOG_START = 50.0  # a learned log-scale's start (its weight exp(s)): a few steps on, float32 still holds it
LOG_STEP = 10.0  # an Adam step size on log-scales: a step moves them by up to about 3 lr


def number(transform: str, arg: str, value: Any, *, finite: bool = True) -> float:
    """A transform's numeric argument; an infinite one only where the transform means it
    (a norm's order): elsewhere it can only make gradients non-finite or do nothing."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"transform {transform!r}: {arg}={value!r} must be a number")
    if math.isnan(value) or (finite and math.isinf(value)):
        raise ValueError(f"transform {transform!r}: {arg}={value!r} must be a {'finite ' if finite else ''}number")
    return float(value)


def positive(transform: str, arg: str, value: Any, *, allow_zero: bool = True, high: float = math.inf) -> float:
    """A finite number >= 0 (> 0 with ``allow_zero=False``) and <= ``high`` (``MAX_STEP`` for a
    step size)."""
    bound = (">= 0" if allow_zero else "> 0") + _at_most(high)
    if isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isfinite(value):
        raise ValueError(f"transform {transform!r}: {arg}={value!r} must be a finite number {bound}")
    v = number(transform, arg, value)
    if v < 0 or (v == 0 and not allow_zero) or v > high:
        raise ValueError(f"transform {transform!r}: {arg}={value!r} must be {bound}")
    return v


def count(what: str, arg: str, value: Any, low: int = 1, high: float = MAX_COUNT) -> int:
    """A whole number from ``low`` to ``high``: an int, or a float of whole value (a sweep's
    ``20.0``); ``what`` names its owner (``per_loss method 'sdmgrad'``, ``transform 'sam'``).
    An iteration count a step runs through is at most ``MAX_COUNT``; a period (every so many
    steps) or a number of tasks at most ``2**53``, the floats that are still exact."""
    high = min(high, EXACT)
    whole = (isinstance(value, int) and not isinstance(value, bool)) or (
        isinstance(value, float) and value.is_integer()
    )
    if not (whole and low <= value <= high):
        raise ValueError(f"{what}: {arg}={value!r} must be a whole number from {low} to {int(high)}")
    return int(value)


def in_range(what: str, arg: str, value: Any, low: float, *, strict: bool = False, high: float = math.inf) -> float:
    """``value`` a number >= ``low`` (> with ``strict``) and <= ``high`` (any finite number for
    ``low=-inf``); ``what`` names its owner in the message (``per_loss method 'cagrad'``)."""
    ok = (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and (value > low if strict else value >= low)
        and value <= high
    )
    if low == -math.inf and not (ok and math.isfinite(value)):  # no lower bound: any finite number
        raise ValueError(f"{what}: {arg}={value!r} must be a finite number")
    if not ok:
        bound = f"> {low}" if strict else f">= {low}"
        raise ValueError(f"{what}: {arg}={value!r} must be a number {bound}" + _at_most(high))
    return float(value)


def _at_most(high: float) -> str:
    return f" and <= {high}" if high < math.inf else ""
