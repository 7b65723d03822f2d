"""Where the losses' paths join in the autograd graph, for a loss weighting's one backward.

A loss weighting's parameters (``trunk.*``) take the gradient of ``sum_i w_i L_i`` and the
others (the heads) that of the plain sum: two backward passes, or one of the plain sum in
which each loss's gradient is scaled by its weight where its path joins the others' (a
head's input, say). Every tensor below the joins then gets the weighted sum's gradient and
every tensor above the plain sum's: the same gradients, where the rule's tensors are the
ones below.
"""

from __future__ import annotations

from torch import Tensor
from torch.autograd.graph import Node

SHARED = -1  # a node more than one loss reaches
HIDING = {"CheckpointFunctionBackward"}  # use_reentrant=True: the segment's graph is built in the backward


def loss_edges(losses: list[Tensor], params: list[Tensor], trainable: list[Tensor]) -> dict | None:
    """Where the losses' paths join: per node that one loss alone reaches, (input, loss) for
    each of its inputs that several losses reach. In one backward of the plain sum, the
    gradient along those edges scaled by each loss's weight gives every tensor below them
    the weighted sum's gradient and every tensor above the plain sum's. None unless the
    ``trainable`` tensors below are ``params`` and none of ``params`` is above."""
    owner: dict[Node, int] = {}  # the one loss that reaches the node, or SHARED
    for i, loss in enumerate(losses):
        todo = [(loss.grad_fn, i)] if loss.grad_fn is not None else []
        while todo:
            node, by = todo.pop()
            was = owner.get(node)
            now = by if was is None or was == by else SHARED
            if now == was:
                continue  # each node changes at most twice: unseen, one loss's, shared
            owner[node] = now
            if type(node).__name__ in HIDING:
                return None  # its backward reaches tensors the graph does not show
            todo += [(nxt, now) for nxt, _ in node.next_functions if nxt is not None]
    if any(loss.grad_fn is not None and owner[loss.grad_fn] == SHARED for loss in losses):
        return None  # a loss that is another's (or part of it)
    mine, others = {id(p) for p in params}, {id(p) for p in trainable} - {id(p) for p in params}
    edges: dict[Node, list[tuple[int, int]]] = {}
    for node, by in owner.items():
        nexts = node.next_functions
        if not nexts:  # a tensor's gradient accumulator (or a leaf op)
            leaf = id(_leaf(node))
            if leaf in (others if by == SHARED else mine):
                return None  # a tensor outside the rule below the join, or one of the rule's above
        elif by != SHARED:
            for j, (nxt, _) in enumerate(nexts):
                if nxt is not None and owner[nxt] == SHARED:
                    edges.setdefault(node, []).append((j, by))
    return edges


def _leaf(node: Node) -> Tensor | None:
    """The tensor a gradient accumulator's node writes to (None for any other node)."""
    return getattr(node, "variable", None)
