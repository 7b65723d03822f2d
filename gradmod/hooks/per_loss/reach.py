"""What the losses reach in the autograd graph, walked from them (nothing is run).

Which loss reaches each node: where one loss alone does, one backward of a sum of the
losses tells the losses' gradients apart.

A loss weighting's parameters (``trunk.*``) take the gradient of ``sum_i w_i L_i`` and the
others (the heads) that of the plain sum: two backward passes, or one of the weighted sum
where every other tensor is reached by one loss alone (``loss_owners``). Such a tensor then
holds ``w_i`` times its gradient in the plain sum, and dividing by ``w_i`` gives it back.

A ``modules:`` rule needs its output's k task gradients: where each loss reaches the output
through nodes of its own (``head_edges``), those nodes hand it loss i's gradient in the
backward of the sum.

Where a Linear is answered from its rows, a use of its weight the model's forward did not
show (a penalty on the weight in a loss: ``used_apart``) needs that weight's own task
gradients. Where every path from the losses to the rules' tensors runs through the
frontier's outputs (``reached``), each loss's own pass to them and one batched pass below
serve (``task_grads.task_grads_through``).
"""

from __future__ import annotations

from torch import Tensor
from torch.autograd.graph import Node, get_gradient_edge

from gradmod.hooks.per_loss.entries import Layer

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


def used_apart(losses: list[Tensor], layers: list[Layer], inside: list = ()) -> set[int]:
    """The ``layers`` (ids) whose weight or bias the losses reach other than through the
    layer's outputs of this step: a use outside the model's forward, which the trace cannot
    see (a penalty on the weight in a loss). Their rows' Gram would miss that part. The walk
    stops at the ``inside`` nodes (the model's outputs): below them the trace saw every use."""
    stops = {edge.node for layer in layers for _, edge in layer.calls} | set(inside)
    held = {id(getattr(layer.module, n)): id(layer) for layer in layers for n in layer.names}
    found: set[int] = set()
    seen, todo = set(), [loss.grad_fn for loss in losses if loss.grad_fn is not None]
    while todo:
        node = todo.pop()
        if node in seen or node in stops:
            continue
        seen.add(node)
        nexts = node.next_functions
        if nexts:
            todo += [nxt for nxt, _ in nexts if nxt is not None]
        elif (leaf := getattr(node, "variable", None)) is not None and id(leaf) in held:  # a gradient accumulator
            found.add(held[id(leaf)])
    return found


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
