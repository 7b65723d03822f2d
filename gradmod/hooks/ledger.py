"""The raw-gradient ledger: what hook chains replaced, kept for the non-finite count.

A transform such as ``clamp`` turns ``inf`` into a finite number, yet the trainer must
still learn that the gradient was not finite. A chain that replaces a parameter's
gradient leaves the raw one here, to be counted later together with every other tensor
(no host sync); a module output's raw gradient is counted at once, so activation
gradients are not kept alive until the step ends.
"""

from __future__ import annotations

import torch
from torch import Tensor


class RawLedger:
    """Raw gradients (and counts) noted by the chains since the last ``take``."""

    def __init__(self) -> None:
        self.raw: list[tuple[str, Tensor]] = []  # (parameter, raw gradient its chain replaced)
        self.counted: list[tuple[str, Tensor]] = []  # (module output, its count of non-finite entries)
        self.replaced: set[str] = set()  # parameters whose raw gradient is not in their .grad

    def note(self, key: str, raw: Tensor, result: Tensor, is_param: bool) -> None:
        """One chain call on ``key``: ``raw`` came in, ``result`` went out."""
        if not is_param:
            self.counted.append((key, torch.count_nonzero(raw * 0)))  # inf * 0 and nan * 0 are nan
        elif result is not raw:
            self.raw.append((key, raw))
            self.replaced.add(key)

    def take(self) -> tuple[list[tuple[str, Tensor]], list[tuple[str, Tensor]], set[str]]:
        """(raw gradients to count, counts already taken, replaced parameters), and a fresh start."""
        out = (self.raw, self.counted, self.replaced)
        self.raw, self.counted, self.replaced = [], [], set()
        return out
