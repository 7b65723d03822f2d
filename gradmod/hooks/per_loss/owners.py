"""Which loss reaches each node of the autograd graph: where one loss alone does, one
backward of a sum of the losses tells the losses' gradients apart.

A loss weighting's parameters (``trunk.*``) take the gradient of ``sum_i w_i L_i`` and the
others (the heads) that of the plain sum: two backward passes, or one of the weighted sum
where every other tensor is reached by one loss alone (``loss_owners``). Such a tensor then
holds ``w_i`` times its gradient in the plain sum, and dividing by ``w_i`` gives it back.

A ``modules:`` rule needs its output's k task gradients: where each loss reaches the output
through nodes of its own (``head_edges``), those nodes hand it loss i's gradient in the
backward of the sum.
"""

from __future__ import annotations

from torch import Tensor
from torch.autograd.graph import Node

SHARED = -1  # a node more than one loss reaches
HIDING = {"CheckpointFunctionBackward"}  # use_reentrant=True: the segment's graph is built in the backward


def loss_owners(losses: list[Tensor]) -> dict[int, int] | None:
    """``{id(tensor): i}`` for each leaf tensor the losses reach: the index of the one loss
    that reaches it, or SHARED. None where the graph does not show every tensor it reaches
    (a reentrant checkpoint)."""
    owner = _owners(losses)
    if owner is None:
        return None
    return {
        id(leaf): i
        for node, i in owner.items()
        if not node.next_functions and (leaf := getattr(node, "variable", None)) is not None  # a gradient accumulator
    }


def head_edges(losses: list[Tensor], out: Tensor) -> list[list[tuple[Node, list[int]]]] | None:
    """Per loss, the nodes that take ``out`` in and the positions of ``out`` among their
    inputs, where one loss alone reaches each such node (its head): what those nodes hand
    ``out`` in the backward of the sum is then that loss's gradient of ``out``. None where two
    losses meet above ``out`` on the way to it, or the graph hides nodes."""
    target = out.grad_fn
    if target is None or any(loss.grad_fn is target for loss in losses):
        return None  # a loss that is the output itself hands it its gradient through no node
    into: dict[Node, list[int]] = {}
    owner = _owners(losses, stop=(target, out.output_nr), into=into)
    if owner is None:
        return None
    edges: list[list[tuple[Node, list[int]]]] = [[] for _ in losses]
    for node, at in into.items():
        if owner[node] == SHARED:
            return None
        edges[owner[node]].append((node, at))
    return edges


def _owners(
    losses: list[Tensor], stop: tuple[Node, int] | None = None, into: dict[Node, list[int]] | None = None
) -> dict[Node, int] | None:
    """The one loss that reaches each node (or SHARED), not walking below ``stop`` (a node and
    one of its outputs), whose takers ``into`` gets (node -> the positions of ``stop`` among
    its inputs); None where the graph does not show every node (a reentrant checkpoint's
    segment)."""
    owner: dict[Node, int] = {}
    below = None if stop is None else stop[0]
    for i, loss in enumerate(losses):
        todo = [(loss.grad_fn, i)] if loss.grad_fn is not None else []
        while todo:
            node, by = todo.pop()
            was = owner.get(node)
            now = by if was is None or was == by else SHARED
            if now == was:
                continue  # each node changes at most twice: unseen, one loss's, shared
            owner[node] = now
            nexts = node.next_functions
            if nexts and node is not below:
                if type(node).__name__ in HIDING:
                    return None  # its backward reaches tensors the graph does not show
                todo += [(nxt, now) for nxt, _ in nexts if nxt is not None]
                if into is not None and was is None and (at := [j for j, e in enumerate(nexts) if e == stop]):
                    into[node] = at
    return owner
