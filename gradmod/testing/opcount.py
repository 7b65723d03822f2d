"""Count the aten ops a piece of code dispatches: a deterministic measure of step cost.

On a GPU every aten op is at least one kernel launch and several microseconds of host
time, so for small and medium models the op count *is* the step time; unlike a timing,
the count is the same on every run and machine, so tests can assert budgets on it.

    with OpCounter() as ops:
        train_one_step()
    print(ops.count, ops.top(5))
"""

from __future__ import annotations

from collections import Counter

from torch.utils._python_dispatch import TorchDispatchMode

# Every op that reaches the dispatcher counts (views too: each costs host time);
# pass free_ops to leave some out.
_FREE: frozenset[str] = frozenset()


class OpCounter(TorchDispatchMode):
    """A ``TorchDispatchMode`` that counts every aten op dispatched inside it.

    ``count``: the total; ``by_op``: a ``Counter`` of op name -> calls; ``free_ops``:
    op names (e.g. ``"aten.detach.default"``) left out of both.
    """

    def __init__(self, free_ops=_FREE):
        super().__init__()
        self.free_ops = frozenset(free_ops)
        self.by_op: Counter[str] = Counter()

    @property
    def count(self) -> int:
        return sum(self.by_op.values())

    def top(self, n: int = 10) -> list[tuple[str, int]]:
        """The ``n`` most called ops, most first."""
        return self.by_op.most_common(n)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name not in self.free_ops:
            self.by_op[name] += 1
        return func(*args, **(kwargs or {}))
