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

A loss weighting on those parameters (``loss_edges``) needs no task gradient at all: in the
one backward of the plain sum, each loss's gradient entering the representation is scaled
by its weight on its way in, so the parameters below get the weighted sum's gradient and
the heads the plain sum's, the gradients two backward passes would give.
"""

from __future__ import annotations

import os

from torch import Tensor, nn
from torch.autograd.graph import Node, get_gradient_edge


def frontier_module(model: nn.Module, params: list[nn.Parameter]) -> nn.Module | None:
    """The deepest module below the model whose subtree holds every one of ``params``."""
    wanted = {id(p) for p in params}
    owners = [name.split(".")[:-1] for name, p in model.named_parameters(remove_duplicate=False) if id(p) in wanted]
    common = os.path.commonprefix(owners) if owners else []
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


def loss_edges(
    losses: list[Tensor], frontier: list[Tensor], params: list[Tensor], trainable: list[Tensor]
) -> dict[Node, list[tuple[int, int]]] | None:
    """Where each loss's gradient enters the ``frontier`` tensors: per node, (input, loss)
    for each of its inputs that is one of them. None unless each such node is reached from
    one loss alone, every path from the losses to ``params`` runs through the frontier, and
    below it no other of the ``trainable`` tensors gets a gradient."""
    stop: dict = {}
    for t in frontier:
        stop.setdefault(t.grad_fn, set()).add(t.output_nr)
    mine = {id(p) for p in params}
    edges: dict[Node, list[tuple[int, int]]] = {}
    owner: dict[Node, int] = {}
    for i, loss in enumerate(losses):
        seen, todo = set(), [loss.grad_fn] if loss.grad_fn is not None else []
        while todo:
            node = todo.pop()
            if node in seen:
                continue
            seen.add(node)
            nexts = node.next_functions
            if not nexts and id(_leaf(node)) in mine:
                return None  # a path around the frontier
            for j, (nxt, nr) in enumerate(nexts):
                if nxt is None:
                    continue
                if nxt not in stop:
                    todo.append(nxt)
                elif nr not in stop[nxt] or owner.setdefault(node, i) != i:
                    return None  # another output of the frontier's op; a node two losses share
                else:
                    edges.setdefault(node, []).append((j, i))
    others = {id(p) for p in trainable} - mine
    seen, todo = set(), list(stop)
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        nexts = node.next_functions
        if not nexts and id(_leaf(node)) in others:
            return None  # the frontier's input reaches a tensor outside ``params``
        todo += [nxt for nxt, _ in nexts if nxt is not None]
    return edges


def _leaf(node: Node) -> Tensor | None:
    """The tensor a gradient accumulator's node writes to (None for any other node)."""
    return getattr(node, "variable", None)
