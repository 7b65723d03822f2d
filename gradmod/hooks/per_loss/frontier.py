"""Where the task gradients may go through a shared representation: each loss's own pass down
to it, then one batched pass below it (``task_grads.task_grads_through``).

A batched backward of k losses carries k rows through every op, so each task's head also
runs for the k - 1 rows that are zero there: k heads cost k^2 head passes and their k
gradients of the representation are added in full. Where every path from the losses to the
rules' tensors runs through the outputs of one module (the smallest holding all the rules'
parameters: ``trunk`` for ``trunk.*``), each loss goes to those outputs alone (its own head),
and the k gradients found there go down together. Any other path (a tied weight used by a
head, a loss on a parameter, another output of the op that made the representation) and the
step takes the ordinary batched backward instead: always the same gradients.
"""

from __future__ import annotations

import os

from torch import Tensor, nn
from torch.autograd.graph import get_gradient_edge

CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)  # held, never called


def frontier_module(model: nn.Module, params: list[nn.Parameter]) -> nn.Module | None:
    """The deepest module below the model whose subtree holds every one of ``params`` and
    which is called (a ModuleList's layers: the module holding the list)."""
    wanted = {id(p) for p in params}
    owners = [name.split(".")[:-1] for name, p in model.named_parameters(remove_duplicate=False) if id(p) in wanted]
    common = os.path.commonprefix(owners) if owners else []
    while common and isinstance(model.get_submodule(".".join(common)), CONTAINERS):
        common = common[:-1]
    return model.get_submodule(".".join(common)) if common else None


def reached(losses: list[Tensor], frontier: list[Tensor], inputs: list) -> list[Tensor] | None:
    """The ``frontier`` tensors the losses reach, when every path of the autograd graph from
    ``losses`` to ``inputs`` (parameters, gradient edges) passes through one of them (walked
    from the losses, stopping there); else None."""
    stop: dict = {}
    for t in frontier:
        edge = get_gradient_edge(t)
        stop.setdefault(edge.node, {})[edge.output_nr] = t
    targets = {get_gradient_edge(x).node if isinstance(x, Tensor) else x.node for x in inputs}
    found: dict[int, Tensor] = {}
    seen, todo = set(), [loss.grad_fn for loss in losses if loss.grad_fn is not None]
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        if node in targets:
            return None
        for nxt, nr in node.next_functions:
            if nxt is None:
                continue
            if nxt in stop:
                if nr not in stop[nxt]:
                    return None  # another output of the node that made the representation
                found[id(stop[nxt][nr])] = stop[nxt][nr]
                continue
            todo.append(nxt)
    return list(found.values())
