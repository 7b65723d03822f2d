"""The raw-gradient ledger: what hook chains replaced, kept for the non-finite count.

A transform such as ``clamp`` turns ``inf`` into a finite number, yet the trainer must
still learn that the gradient was not finite. A chain that replaces a parameter's
gradient leaves the raw one here, to be counted later together with every other tensor
(no host sync); a module output's raw gradient is counted at once, so activation
gradients are not kept alive until the step ends. Without a consumer (nothing has taken
within two backward passes of attaching, as in a loop without the trainer's guard) the
ledger stops keeping, so such a loop holds no gradients and pays nothing for it.
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
        self.armed = True  # keeping; False once it is clear that nobody takes
        self.consumer = False  # someone has taken: keep for good
        self._backwards = 0  # backward passes noted while no one has taken
        self._queued = False

    def note(self, key: str, raw: Tensor, result: Tensor, is_param: bool) -> None:
        """One chain call on ``key``: ``raw`` came in, ``result`` went out."""
        if not self.keeping():
            return
        if not is_param:
            self.counted.append((key, torch.count_nonzero(raw * 0)))  # inf * 0 and nan * 0 are nan
        elif result is not raw:
            self.raw.append((key, raw))
            self.replaced.add(key)

    def take(self) -> tuple[list[tuple[str, Tensor]], list[tuple[str, Tensor]], set[str]]:
        """(raw gradients to count, counts already taken, replaced parameters), and a fresh start."""
        out = (self.raw, self.counted, self.replaced)
        self.consumer = self.armed = True
        self.raw, self.counted, self.replaced = [], [], set()
        return out

    def keeping(self) -> bool:
        """Whether to keep what this backward's chains replace (counts the backward passes
        while no one has taken)."""
        if self.armed and not self.consumer and not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
        return self.armed

    def add_counts(self, keys: list[str], counts: list[Tensor]) -> None:
        """Counts of raw gradients a chain transformed in place in ``.grad`` (``keys``: parameters)."""
        self.counted.extend(zip(keys, counts))
        self.replaced.update(keys)

    def _backward_done(self) -> None:
        self._queued = False
        self._backwards += 1
        if self._backwards >= 2 and not self.consumer:
            self.armed = False
            self.raw, self.counted, self.replaced = [], [], set()
