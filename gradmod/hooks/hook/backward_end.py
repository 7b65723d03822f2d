"""What the hook-stage chains leave for the end of backward, run there together.

Two kinds of work: a chain of in-place-able transforms and ``log`` observers whose tensor
may wait (``defer``) runs on ``.grad`` at the end of backward, one foreach op per
transform for all the tensors of its rules (a clamp among them); and a chain does not run
its ``log`` observers on small gradients: it hands them the tensors they saw, and at the
end of backward ``observe_batch`` computes the rows of each rule's observers at each chain
position in a few ops for all their tensors, so ``log`` costs few kernel launches however
many tensors it watches. A big gradient (``BIG``
entries or more) is observed at once, in its hook, while it is still in cache.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from gradmod.hooks.stats.grad_stats import GradStats, observe_batch, observe_pairs
from gradmod.hooks.stats.rows import BIG

Slot = tuple[str, int]  # (rule, position in the rule's transforms)


_is_initialized = torch.distributed.is_initialized if torch.distributed.is_available() else (lambda: False)


def in_distributed() -> bool:
    return _is_initialized()


class BackwardEnd:
    """The deferred chains and the observations pending until the end of the current
    backward, per slot."""

    def __init__(self) -> None:
        self._slots: dict[Slot, tuple[list[GradStats], list[Any]]] = {}  # slot -> (observers, sources)
        self._deferred: dict[tuple, tuple[list, list[nn.Parameter], list[str]]] = {}  # chain -> (chains, params, keys)
        self.ledger = None  # the raw-gradient ledger, told of what deferred chains replace

    def _queue(self) -> None:
        if not self._slots and not self._deferred:
            torch.autograd.Variable._execution_engine.queue_callback(self.flush)

    def defer(self, group: tuple, steps: list, param: nn.Parameter, key: str, ledger) -> None:
        """A chain (``steps``) of in-place-able transforms and ``log`` observers, run on
        ``param.grad`` at the end of backward with every parameter of the same rules and
        steps (``group``): one foreach op per transform, the rows of each observer position
        together."""
        if not self._deferred:
            self._queue()
            self.ledger = ledger
        entry = self._deferred.get(group)
        if entry is None:
            entry = self._deferred[group] = ([], [], [])
        entry[0].append(steps)
        entry[1].append(param)
        entry[2].append(key)

    def _run_deferred(self, deferred: dict) -> None:
        for chains, params, keys in deferred.values():
            grads = [p.grad for p in params]
            if self.ledger is not None and self.ledger.keeping():  # the raw count, before the transforms
                self.ledger.add_counts(keys, torch._foreach_norm(torch._foreach_mul(grads, 0), 0))  # inf*0, nan*0: nan
            for k, (_, step) in enumerate(chains[0]):
                if not step.observer:  # stateless: the first parameter's stands for all
                    step.inplace(grads)
                    continue
                observers = [chain[k][1].fn for chain in chains]  # each tensor's own
                observe_batch(observers, grads, in_place=True, histograms=True)

    def add(self, seen: list[tuple[GradStats, Tensor, Slot]], result: Tensor, param: nn.Parameter | None) -> None:
        """One chain call's observations in chain order; ``result`` is what the chain
        returned for ``param`` (None for a module output)."""
        if seen[0][1].numel() >= BIG:  # one tensor's chain: every observation has its size
            for obs, t, _ in seen:
                obs.observe(t)
            return
        self._queue()
        # Holding the tensor autograd is about to store in an empty .grad would make it copy
        # the tensor; read that one from .grad at the end of backward instead.
        steal = param is not None and param.grad is None and not in_distributed()
        for obs, t, slot in seen:
            observers, sources = self._slots.setdefault(slot, ([], []))
            observers.append(obs)
            sources.append(param if steal and t is result else t)

    def add_small(self, slots: list[tuple[GradStats, Slot]], grad: Tensor, param: nn.Parameter) -> None:
        """``add`` of a small parameter gradient that its chain only observes."""
        if not self._slots and not self._deferred:
            self._queue()
        source = param if param.grad is None and not _is_initialized() else grad
        for obs, slot in slots:
            entry = self._slots.get(slot)
            if entry is None:
                entry = self._slots[slot] = ([], [])
            entry[0].append(obs)
            entry[1].append(source)

    def flush(self) -> None:
        """End of backward: each slot's rows, computed together (``pre`` slots come first,
        as in the chains)."""
        slots, deferred = list(self._slots.values()), self._deferred
        self.clear()
        self._run_deferred(deferred)
        done: set[int] = set()
        for j, (observers, sources) in enumerate(slots):
            if j in done:
                continue
            tensors = [s.grad if isinstance(s, nn.Parameter) else s for s in sources]
            k = _partner(slots, j) if observers[0].keep is not None else None
            if k is None:
                observe_batch(observers, tensors)
                continue
            done.add(k)
            posts, after = slots[k]
            observe_pairs(observers, tensors, posts, [s.grad if isinstance(s, nn.Parameter) else s for s in after])

    def clear(self) -> None:
        self._slots, self._deferred = {}, {}


def _partner(slots: list, j: int) -> int | None:
    """The slot whose observers are the ``post`` partners of slot ``j``'s, in order."""
    pres = slots[j][0]
    for k in range(j + 1, len(slots)):
        posts = slots[k][0]
        if len(posts) == len(pres) and all(q.pre is p for p, q in zip(pres, posts)):
            return k
    return None
