"""A statistics buffer: one row per call, kept on the device, read at log points.

``log`` (``GradStats``), the group transforms' ``NormRecord`` and the per_sample stage's
records share this protocol: ``add`` a row per call (no host sync), ``take`` the buffer
folded into one tensor and start afresh, ``summarize`` the host values into a dict,
``state_dict``/``load_state_dict`` for checkpoints. Past ``COMPACT_AT`` pending rows fold into
one on the device, so memory stays bounded. ``HookSet.read_stats`` reads every buffer of a
step with one host sync.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor


class StatBuffer:
    """Rows added per call; a subclass says how rows fold (``_fold``) and read (``summarize``)."""

    COMPACT_AT = 256  # pending rows folded into one, so memory stays bounded
    label: str | None = None  # part of the statistics key (``tensor/label``); None: none
    pre = None  # a ``log`` observer's partner; other buffers have none
    histogram = False  # set by HookSet.set_histograms; only ``log`` bins

    def __init__(self) -> None:
        self.calls = 0
        self._rows: list[Tensor] = []

    def add(self, row: Tensor) -> None:
        """One call's row (a device tensor)."""
        self._rows.append(row)
        self.calls += 1
        if len(self._rows) >= self.COMPACT_AT:
            self._compact()

    def _compact(self) -> None:
        self._rows = [self._fold()]

    @property
    def _sum(self) -> Tensor | None:
        """The pending buffer as one row (None when empty)."""
        return self._fold() if self._rows else None

    def _fold(self) -> Tensor:
        """The pending rows as one (there is at least one)."""
        raise NotImplementedError

    def _reset(self) -> None:
        self.calls, self._rows = 0, []

    def take(self) -> tuple[int, Tensor | None]:
        """The pending buffer (calls, device tensor or None) and a fresh start; no sync."""
        out, calls = (self._fold() if self._rows else None), self.calls
        self._reset()
        return calls, out

    @staticmethod
    def summarize(calls: int, values: list[float], paired: bool = False) -> dict[str, Any]:
        """The host values of ``take()``'s tensor as the statistics dict."""
        raise NotImplementedError

    def read(self) -> dict[str, Any] | None:
        """``take`` and ``summarize`` (one host sync); None when nothing was added."""
        calls, acc = self.take()
        return None if acc is None else self.summarize(calls, acc.tolist(), self.pre is not None)

    def state_dict(self) -> dict[str, Any]:
        """The buffer in progress (calls and its folded row), for checkpoints."""
        return {
            "calls": self.calls,
            "window": self._fold() if self._rows else None,
        }  # "window": the key checkpoints hold

    def load_state_dict(self, state: Mapping[str, Any], device: torch.device | None = None) -> None:
        """Continue the saved buffer; ``device``: where this run's statistics live."""
        buffer = state["window"]
        self.calls = state["calls"]
        self._rows = [] if buffer is None else [buffer if device is None else buffer.to(device)]
