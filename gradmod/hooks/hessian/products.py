"""Hessian-vector products of one loss by double backward, per group of parameters.

The gradient is taken once with its graph (``create_graph=True``); each product is then one
backward through that graph, ``d(g_S . v)/d w_S``: the block of the Hessian that the group's
parameters ``S`` span. Vectors are flat, in the parameters' dtype and device, in the group's order;
a product is the caller's to change until the next one, which overwrites it.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor


class HessianProducts:
    """``hvp(group, v)`` for the groups of ``params`` (name -> tensor) of the scalar ``loss``;
    ``count``: the products taken so far (the cost of an estimate)."""

    def __init__(self, loss: Tensor, params: dict[str, Tensor], groups: dict[str, Sequence[str]]):
        names = list(params)
        grads = torch.autograd.grad(loss, [params[n] for n in names], create_graph=True, allow_unused=True)
        self._grad = dict(zip(names, grads))
        self._params, self._groups = params, {g: list(ns) for g, ns in groups.items()}
        self.count = 0
        self._out: dict[str, Tensor] = {}
        missing = [n for n in names if self._grad[n] is None]
        if missing:
            raise ValueError(
                f"curvature: the loss does not reach {', '.join(missing[:3])}"
                + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
                + "; select parameters the loss depends on"
            )

    def size(self, group: str) -> int:
        return sum(self._params[n].numel() for n in self._groups[group])

    def like(self, group: str) -> Tensor:
        """A flat vector of the group's size, dtype and device, its values not set."""
        first = self._params[self._groups[group][0]]
        return torch.empty(self.size(group), dtype=first.dtype, device=first.device)

    def gradient(self, group: str) -> Tensor:
        """The loss's gradient over the group, flat (detached, a new tensor)."""
        return torch.cat([self._grad[n].detach().reshape(-1) for n in self._groups[group]])

    def hvp(self, group: str, v: Tensor) -> Tensor:
        """``H_SS v`` for the group ``S``, flat: one buffer per group, written again by the next
        product (a fresh 45 MB vector per product page-faults on ResNet-18's 11M parameters)."""
        names = self._groups[group]
        shapes = [self._params[n].shape for n in names]
        parts = [p.view(shape) for p, shape in zip(v.split([s.numel() for s in shapes]), shapes)]
        grads, params = [self._grad[n] for n in names], [self._params[n] for n in names]
        # v as the gradients' cotangent: the backward of g_S . v without forming the dot's graph
        out = torch.autograd.grad(grads, params, grad_outputs=parts, retain_graph=True, allow_unused=True)
        self.count += 1
        flat = self._out.get(group)
        if flat is None:
            flat = self._out[group] = v.new_empty(v.numel())
        # each piece copied once into its place (a reshape then a cat copied the strided ones twice)
        for piece, o, shape in zip(flat.split([s.numel() for s in shapes]), out, shapes):
            piece.view(shape).copy_(o) if o is not None else piece.zero_()
        return flat
