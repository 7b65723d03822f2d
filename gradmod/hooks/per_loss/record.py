"""The per_loss statistics of one rule, kept on the host (the Gramian is there already).

Per backward call (formed when read, for all the calls of a buffer together): each task's
gradient norm ``sqrt(G_ii)``, each pair's cosine ``G_ij / sqrt(G_ii G_jj)``, the fraction of
pairs that conflict (``G_ij < 0``) and the weights the method gave (for a loss weighting: the
loss weights; no Gramian). Summed over the calls of a log buffer; ``HookSet.read_stats``
reads them as means under
``<rule>/<method>``: ``norm/<task>``, ``cos/<a>,<b>``, ``conflict``, ``weight/<task>``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor


class TaskRecord:
    label = None
    pre = None
    histogram = False

    def __init__(self) -> None:
        self.names: list[str] = []
        self.calls = 0
        self.has_gram = False
        self.has_weights = False
        self._sum: Tensor | None = None  # [norms k, cosines k(k-1)/2, conflict 1, weights k]
        self._pending: list[tuple[np.ndarray | None, np.ndarray | list[float] | None]] = []  # calls not folded in yet

    def add(self, names: list[str], G: Tensor | None, w: Tensor | list[float] | None) -> None:
        """One call's Gramian and weights, kept on the host (copies of a few values); the
        statistics of a buffer's calls are formed together when it is read: numpy's per-op
        cost, paid per call, would be a loss weighting's largest host cost per step."""
        if names != self.names:  # other tasks: a fresh buffer
            self.names, self.calls, self._sum, self._pending = list(names), 0, None, []
        self.has_gram, self.has_weights = G is not None, w is not None
        self._pending.append((_host(G), w if isinstance(w, list) else _host(w)))
        self.calls += 1

    def _fold(self) -> None:
        """The pending calls' rows, added to the buffer's sum one call after another (the
        same bits however the calls are split between reads and checkpoints)."""
        if not self._pending:
            return
        k = len(self.names)
        i, j = np.triu_indices(k, 1)
        rows = np.zeros((len(self._pending), 2 * k + len(i) + 1))
        with_gram = [c for c, (g, _) in enumerate(self._pending) if g is not None]
        if with_gram:
            g = np.stack([self._pending[c][0] for c in with_gram])  # [calls, k, k]
            d = np.sqrt(np.clip(np.diagonal(g, axis1=1, axis2=2), 0.0, None))
            rows[with_gram, :k] = d
            rows[with_gram, k : k + len(i)] = g[:, i, j] / np.maximum(d[:, i] * d[:, j], 1e-300)
            rows[with_gram, k + len(i)] = (g[:, i, j] < 0).mean(1) if len(i) else 0.0
        for c, (_, w) in enumerate(self._pending):
            if w is not None:
                rows[c, -k:] = w
        for row in torch.from_numpy(rows):
            self._sum = row if self._sum is None else self._sum + row
        self._pending = []

    def take(self) -> tuple[int, Tensor | None]:
        self._fold()
        out, calls = self._sum, self.calls
        self._sum, self.calls = None, 0
        return calls, out

    def summarize(self, calls: int, values: list[float], paired: bool = False) -> dict[str, Any]:
        k, names = len(self.names), self.names
        out: dict[str, Any] = {}
        if self.has_gram:
            for i, n in enumerate(names):
                out[f"norm/{n}"] = values[i] / calls
            at = k
            for i in range(k):
                for j in range(i + 1, k):
                    out[f"cos/{names[i]},{names[j]}"] = values[at] / calls
                    at += 1
            out["conflict"] = values[at] / calls
        if self.has_weights:
            for i, n in enumerate(names):
                out[f"weight/{n}"] = values[len(values) - k + i] / calls
        out["calls"] = calls
        return out

    def state_dict(self) -> dict[str, Any]:
        self._fold()
        return {
            "names": list(self.names),
            "calls": self.calls,
            "sum": self._sum,
            "has_gram": self.has_gram,
            "has_weights": self.has_weights,
        }

    def load_state_dict(self, state: Mapping[str, Any], device: torch.device | None = None) -> None:
        self.names, self.calls, self._sum = list(state["names"]), state["calls"], state["sum"]
        self._pending = []
        self.has_gram, self.has_weights = state["has_gram"], state["has_weights"]


def _host(t: Tensor | None) -> np.ndarray | None:
    """A float64 host copy (the method's tensor may be its own state)."""
    return None if t is None else np.array(t.detach().to("cpu", torch.float64).numpy())
