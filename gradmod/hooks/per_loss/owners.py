"""Which loss reaches each tensor in the autograd graph, for a loss weighting's one backward.

A loss weighting's parameters (``trunk.*``) take the gradient of ``sum_i w_i L_i`` and the
others (the heads) that of the plain sum: two backward passes, or one of the weighted sum
where every other tensor is reached by one loss alone. Such a tensor then holds ``w_i`` times
its gradient in the plain sum, and dividing by ``w_i`` gives it back.
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
    owner: dict[Node, int] = {}  # the one loss that reaches the node, or SHARED
    leaves: dict[int, int] = {}
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
            if nexts:
                if type(node).__name__ in HIDING:
                    return None  # its backward reaches tensors the graph does not show
                todo += [(nxt, now) for nxt, _ in nexts if nxt is not None]
            elif (leaf := getattr(node, "variable", None)) is not None:  # a gradient accumulator
                leaves[id(leaf)] = now
    return leaves
