"""Which backward is running: the one that fills ``.grad``, or a gradient a loss takes of itself.

A rule acts on the gradient that trains the model: the backward that accumulates into the
parameters' ``.grad`` (``loss.backward()``, ``hooks.backward``, ``backward(inputs=...)``). A
``torch.autograd.grad(...)`` inside the loss (a gradient penalty, a Hessian-vector product)
hands its gradients back instead, and the tensor hooks on its way fire all the same: a
parameter's as autograd.grad captures its gradient, a module output's as the gradient passes.
There the rules do nothing, so autograd.grad returns exactly what it returns without gradmod;
the backward of the loss that holds the penalty then carries the penalty's gradient too, and
the rules act on it.

The engine tells, per node, whether the backward in progress runs it
(``torch._C._will_engine_execute_node``): a parameter's AccumulateGrad node runs in a backward
that accumulates into it, never under autograd.grad (which raises for a leaf whose gradient it
captures, and answers False for the others). The answer is the same for every hook of one
backward (one graph task), so it is asked once per graph task: a hook pays a lookup of the
task's id (no tensor op).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor
from torch.autograd.graph import get_gradient_edge

_task_id = torch._C._current_graph_task_id
_will_run = torch._C._will_engine_execute_node


class FillsGrad:
    """``fills()``: whether the backward in progress accumulates into the ``.grad`` of one of
    ``params`` (a model's parameters) rather than handing gradients back (autograd.grad).
    Their AccumulateGrad nodes are taken once here (a parameter frozen now: when it trains);
    holding them keeps the ones autograd uses."""

    def __init__(self, params: Iterable[Tensor]):
        self._params = list(dict.fromkeys(params))  # a tied parameter once
        self._nodes: dict[int, Any] = {id(p): _accumulator(p) for p in self._params if p.requires_grad}
        self._task, self._fills = -2, False

    def __call__(self) -> bool:
        task = _task_id()
        if task != self._task:
            self._task, self._fills = task, self._ask()
        return self._fills

    def _ask(self) -> bool:
        for p in self._params:
            if not p.requires_grad:
                continue
            node = self._nodes.get(id(p))
            if node is None:
                node = self._nodes[id(p)] = _accumulator(p)
            try:
                if _will_run(node):
                    return True
            except RuntimeError:  # autograd.grad captures this parameter's gradient: nothing accumulates
                return False
        return False


def _accumulator(p: Tensor) -> Any:
    """The AccumulateGrad node that writes ``p.grad``."""
    return get_gradient_edge(p).node
