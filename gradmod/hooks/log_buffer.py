"""``log`` observations of one backward, computed together at its end.

At the hook stage a chain does not run its ``log`` observers: it hands them the tensors
they saw, and at the end of backward ``batch_rows`` computes the rows of all of them in a
few ops, so ``log`` costs few kernel launches however many tensors it watches.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from gradmod.hooks.stats import GradStats, batch_rows


def in_distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


class LogBuffer:
    """The observations pending until the end of the current backward."""

    def __init__(self) -> None:
        self._pending: list[tuple[GradStats, Any]] = []  # (observer, its source)
        self._pairs: list[tuple[GradStats, Any, GradStats, Any]] = []  # (pre, its source, post, its source)

    def add(self, seen: list[tuple[GradStats, Tensor]], result: Tensor, param: nn.Parameter | None) -> None:
        """One chain call's observations; ``result`` is what the chain returned for ``param``
        (None for a module output)."""
        if not seen:
            return
        if not self._pending and not self._pairs:
            torch.autograd.Variable._execution_engine.queue_callback(self.flush)
        # Holding the tensor autograd is about to store in an empty .grad would make it copy
        # the tensor; read that one from .grad at the end of backward instead.
        steal = param is not None and param.grad is None and not in_distributed()
        sources = [(obs, param if steal and t is result else t) for obs, t in seen]
        waiting: dict[int, tuple[GradStats, Any]] = {}  # pre observers of this call, until their post
        for obs, src in sources:
            if obs.pre is not None and id(obs.pre) in waiting:
                self._pairs.append((*waiting.pop(id(obs.pre)), obs, src))
            elif obs.keep is not None:
                waiting[id(obs)] = (obs, src)
            else:
                self._pending.append((obs, src))
        self._pending.extend(waiting.values())

    def flush(self) -> None:
        """End of backward: the rows of every pending observation, computed together."""
        pairs, singles = self._pairs, self._pending
        self.clear()
        order = [p for p, _, _, _ in pairs] + [q for _, _, q, _ in pairs] + [o for o, _ in singles]
        sources = [s for _, s, _, _ in pairs] + [s for _, _, _, s in pairs] + [s for _, s in singles]
        tensors = [s.grad if isinstance(s, nn.Parameter) else s for s in sources]
        if not tensors:
            return
        for obs, row in zip(order, batch_rows(tensors, len(pairs))):
            obs.add_row(row)

    def clear(self) -> None:
        self._pairs, self._pending = [], []
