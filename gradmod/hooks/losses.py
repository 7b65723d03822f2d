"""One scalar loss, or several named ones: their names and their sum, in one place."""

from __future__ import annotations

from typing import Any, Mapping

from torch import Tensor


def total(losses: Tensor | Mapping[str, Tensor]) -> Tensor:
    """The sum of the named losses (the loss itself when there is one), in their order."""
    if isinstance(losses, Tensor):
        return losses
    parts = list(losses.values())
    return sum(parts[1:], parts[0])


def named(losses: Any) -> dict[str, Tensor]:
    """The losses by name (a sequence's by position); one line for what is not allowed."""
    pairs = losses.items() if isinstance(losses, Mapping) else enumerate(losses)
    by_name = {str(k): x for k, x in pairs}
    if not by_name or not all(isinstance(x, Tensor) and x.dim() == 0 for x in by_name.values()):
        raise ValueError("HookSet.backward: give one scalar loss, or a non-empty mapping or sequence of scalar losses")
    return by_name


def summed(losses: Any) -> Tensor:
    """What a closure returned: one scalar loss, or the sum of a mapping's or a sequence's."""
    return total(losses if isinstance(losses, Tensor) else named(losses))
