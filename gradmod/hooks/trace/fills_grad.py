"""Which backward is running: the one that fills ``.grad``, or a gradient a loss takes of itself.

A rule acts on the gradient that trains the model: a backward that accumulates into ``.grad``
(``loss.backward()``, ``hooks.backward``, ``backward(inputs=...)``). A
``torch.autograd.grad(...)`` inside the loss (a gradient penalty, a Hessian-vector product)
hands its gradients back instead, and the tensor hooks on its way fire all the same: a
parameter's as autograd.grad captures its gradient, a module output's as the gradient passes.
There the rules do nothing, so autograd.grad returns exactly what it returns without gradmod;
the backward of the loss that holds the penalty then carries the penalty's gradient too, and
the rules act on it.

The engine tells, per node, whether the backward in progress runs it
(``torch._C._will_engine_execute_node``): an AccumulateGrad node runs in a backward that
accumulates into its tensor, never under autograd.grad (which raises for a leaf whose gradient
it captures, and answers False for the others). So the first AccumulateGrad node with an answer
decides: the model's parameters' first (a plain backward answers True for any in its graph),
then, where none of them is in this backward's graph (a weight the per_sample stage runs
detached, an FSDP2 parameter whose unsharded copy the forward used), the leaves below the
node running now. The answer is the same for every hook of one backward (one graph task), so
it is asked once per graph task: a hook pays a lookup of the task's id (no tensor op).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import Tensor
from torch.autograd.graph import get_gradient_edge
from torch.nn.parameter import is_lazy

_task_id = torch._C._current_graph_task_id
_will_run = torch._C._will_engine_execute_node


class FillsGrad:
    """Called in a hook: whether the backward in progress accumulates into ``.grad`` (one of
    ``params``, a model's parameters, or a leaf below the hook) rather than handing gradients
    back (autograd.grad).
    Their AccumulateGrad nodes are taken once here (a parameter frozen now, or a lazy module's:
    when it trains); holding them keeps the ones autograd uses."""

    def __init__(self, params: Iterable[Tensor]):
        self._params = list(dict.fromkeys(params))  # a tied parameter once
        self._nodes: dict[int, Any] = {id(p): _accumulator(p) for p in self._params if _trains(p)}
        self._task, self._fills = -2, False

    def __getstate__(self) -> dict[str, Any]:  # a deep copy of a hooked model: the nodes of the copies
        return {"params": self._params}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["params"])

    def __call__(self) -> bool:
        task = _task_id()
        if task != self._task:
            self._task, self._fills = task, self._ask()
        return self._fills

    def _ask(self) -> bool:
        found = _first_answer(self._param_nodes())
        if found is None:  # no parameter of the model in this backward's graph: the leaves below this hook
            here = torch._C._current_autograd_node()
            found = None if here is None else _first_answer(_leaves_below(here))
        return bool(found)

    def _param_nodes(self) -> Iterator[Any]:
        for p in self._params:
            if _trains(p):
                node = self._nodes.get(id(p))
                if node is None:
                    node = self._nodes[id(p)] = _accumulator(p)
                yield node


def _first_answer(nodes: Iterable[Any]) -> bool | None:
    """True at the first AccumulateGrad node the backward in progress runs, False at the first
    whose gradient autograd.grad captures, None where every one is outside this backward."""
    for node in nodes:
        try:
            if _will_run(node):
                return True
        except RuntimeError:  # autograd.grad captures this leaf's gradient: nothing accumulates
            return False
    return None


def _leaves_below(start: Any) -> Iterator[Any]:
    """The AccumulateGrad nodes of the graph under ``start``, depth first, each once."""
    seen, todo = {start}, [start]
    while todo:
        node = todo.pop()
        if isinstance(node, _ACCUMULATE):
            yield node
            continue
        for nxt, _ in node.next_functions:
            if nxt is not None and nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)


def _trains(p: Tensor) -> bool:
    """``p`` takes a gradient (a lazy module's parameter once it is materialised)."""
    return p.requires_grad and not is_lazy(p)


def _accumulator(p: Tensor) -> Any:
    """The AccumulateGrad node that writes ``p.grad``."""
    return get_gradient_edge(p).node


_ACCUMULATE = type(_accumulator(torch.zeros((), requires_grad=True)))
