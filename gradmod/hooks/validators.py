"""Checks of the numeric arguments of transforms and per_loss methods, each a one-line
ValueError naming the bad one.

A leaf: the transforms of every stage import it, and it imports nothing of gradmod.
"""

from __future__ import annotations

import math
from typing import Any


def number(transform: str, arg: str, value: Any, *, finite: bool = True) -> float:
    """A transform's numeric argument; an infinite one only where the transform means it
    (a norm's order): elsewhere it can only make gradients non-finite or do nothing."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"transform {transform!r}: {arg}={value!r} must be a number")
    if math.isnan(value) or (finite and math.isinf(value)):
        raise ValueError(f"transform {transform!r}: {arg}={value!r} must be a {'finite ' if finite else ''}number")
    return float(value)


def positive(transform: str, arg: str, value: Any, *, allow_zero: bool = True) -> float:
    """``number``, and >= 0 (> 0 with ``allow_zero=False``)."""
    v = number(transform, arg, value)
    if v < 0 or (v == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"transform {transform!r}: {arg}={value!r} must be {bound}")
    return v


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
        raise ValueError(
            f"{what}: {arg}={value!r} must be a number {bound}" + (f" and <= {high}" if high < math.inf else "")
        )
    return float(value)
