"""The per_loss statistics of one rule, kept on the host (the Gramian is there already).

Per backward call: each task's gradient norm ``sqrt(G_ii)``, each pair's cosine
``G_ij / sqrt(G_ii G_jj)``, the fraction of pairs that conflict (``G_ij < 0``) and the
weights the method gave (for a loss weighting: the loss weights; no Gramian). Summed over
the calls of a log window; ``HookSet.read_stats`` reads them as means under
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

    def add(self, names: list[str], G: Tensor | None, w: Tensor | None) -> None:
        """One call's row, in numpy (a few k x k host values: torch's per-op cost would dominate)."""
        k = len(names)
        if names != self.names:  # other tasks: a fresh window
            self.names, self.calls, self._sum = list(names), 0, None
        self.has_gram, self.has_weights = G is not None, w is not None
        row = np.zeros(2 * k + k * (k - 1) // 2 + 1)
        if G is not None:
            g = G.detach().to("cpu", torch.float64).numpy()
            d = np.sqrt(np.clip(np.diagonal(g), 0.0, None))
            i, j = np.triu_indices(k, 1)
            row[:k] = d
            row[k : k + len(i)] = g[i, j] / np.maximum(d[i] * d[j], 1e-300)
            row[k + len(i)] = (g[i, j] < 0).mean() if len(i) else 0.0
        if w is not None:
            row[-k:] = w.detach().to("cpu", torch.float64).numpy()
        t = torch.from_numpy(row)
        self._sum = t if self._sum is None else self._sum + t
        self.calls += 1

    def take(self) -> tuple[int, Tensor | None]:
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
        return {
            "names": list(self.names),
            "calls": self.calls,
            "sum": self._sum,
            "has_gram": self.has_gram,
            "has_weights": self.has_weights,
        }

    def load_state_dict(self, state: Mapping[str, Any], device: torch.device | None = None) -> None:
        self.names, self.calls, self._sum = list(state["names"]), state["calls"], state["sum"]
        self.has_gram, self.has_weights = state["has_gram"], state["has_weights"]
