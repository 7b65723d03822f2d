"""The task Gramian per layer, from a layer's saved input and its k output gradients, and
the weighted update ``sum_i w_i g_i`` written from the same pieces (``stage``'s steps 2 and 3).

A Linear's task gradients are ``b_i^T a``. Where the rows are few against the features
(``gram_pays``) its Gramian is ``b_i^T (a a^T) b_j`` and its update ``(sum_i w_i b_i)^T a``:
the k weight gradients are never formed. Everywhere else (more rows, a convolution, a weight
used functionally) the backward forms each tensor's k task gradients itself, in the same
kernels as the input gradients.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn


@dataclass
class Layer:
    """A Linear whose weight (and bias) a rule owns: answered from (a, b) when the rows pay."""

    module: nn.Module
    rule: Any  # the LossRule that owns it
    names: set[str]  # of "weight", "bias"
    calls: list[tuple[Tensor, Any]] = field(default_factory=list)  # (input, output's gradient edge)

    def rows_pay(self, k: int) -> bool:
        """Whether this step's calls take the rows' Gram: fewer flops than k weight gradients.
        Else the backward forms its k task gradients directly (autograd's own weight matmul)."""
        m = self.module
        rows = sum(a.numel() // a.shape[-1] for a, _ in self.calls)
        return "weight" in self.names and gram_pays(rows, m.in_features, m.out_features, k)


def linear_rows(x: Tensor) -> Tensor:
    """A Linear's input as rows ``[N, features]``: the weight gradient is ``b^T a``."""
    return x.reshape(-1, x.shape[-1])


def out_rows(g: Tensor) -> Tensor:
    """A Linear's output gradients ``[k, ..., out]`` as ``[k, N, out]``, rows matching ``linear_rows``."""
    return g.reshape(g.shape[0], -1, g.shape[-1])


def gram_pays(n: int, d_in: int, d_out: int, k: int) -> bool:
    """Row Gram (``n^2 (d_in + k d_out)``) against k weight gradients (``k n d_in d_out``)."""
    return n * (d_in + k * d_out) < k * d_in * d_out


def entries(parts: list) -> list[tuple]:
    """One entry per tensor the rule answers for: a layer called several times in the
    forward answers once (its task gradient is the sum over the calls). Half-precision
    gradients are taken in float32 (the Gramian's sums need the range)."""
    linear: dict[int, tuple] = {}
    out = []
    for (_, what, obj), g in parts:
        g = g.float() if g.dtype in (torch.float16, torch.bfloat16) else g
        if what != "layer":
            out.append((what, obj, g))
            continue
        layer, a = obj
        entry = linear.setdefault(id(layer), ("linear", layer, [], []))
        entry[2].append(linear_rows(a).to(g.dtype))
        entry[3].append(out_rows(g))
    return [("linear", layer, _cat(A, 0), _cat(B, 1)) for _, layer, A, B in linear.values()] + out


def _cat(parts: list[Tensor], dim: int) -> Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)  # one call: no copy


def gram(e: tuple) -> Tensor:
    """The entry's part of the Gramian of the task gradients, ``[k, k]``."""
    if e[0] == "linear":
        _, layer, A, B = e
        KB = torch.matmul(A @ A.T, B)  # [k, N, out]: the rows' Gram
        G = B.flatten(1) @ KB.flatten(1).T
        if "bias" in layer.names:
            s = B.sum(1)
            G = G + s @ s.T
        return G
    f = task_rows(e[2])
    return f @ f.T


def pieces(e: tuple) -> list[tuple[str, Tensor, Tensor]]:
    """(kind, tensor, its k task gradients flattened ``[k, numel]``) of an entry."""
    if e[0] == "linear":
        _, layer, A, B = e
        m = layer.module
        out = []
        if "weight" in layer.names:
            out.append(("param", m.weight, (B.transpose(1, 2) @ A).flatten(1)))
        if "bias" in layer.names:
            out.append(("param", m.bias, B.sum(1)))
        return out
    return [(e[0], e[1], task_rows(e[2]))]


def task_rows(g: Tensor) -> Tensor:
    """``[k, *shape]`` as ``[k, numel]``: one row per task (a 0-d tensor's, a scalar
    parameter's such as a learned temperature, is one number)."""
    return g.reshape(g.shape[0], -1)


def update(e: tuple, w: Tensor, replace: dict) -> None:
    """Add ``sum_i w_i g_i`` of the entry to ``.grad`` (or hand it to a module output's hook)."""
    if e[0] == "linear":
        _, layer, A, B = e
        m = layer.module
        bw = torch.tensordot(w.to(B.dtype), B, 1)  # [N, out]
        if "weight" in layer.names:
            add_grad(m.weight, (bw.T @ A).view_as(m.weight))
        if "bias" in layer.names:
            add_grad(m.bias, bw.sum(0))
    else:
        what, obj, g = e
        agg = torch.tensordot(w.to(g.dtype), g, 1)
        if what == "param":
            add_grad(obj, agg)
        else:  # in the output's own dtype (a half one's Gramian ran in float32), as its hook must give
            replace[id(obj)] = (obj, agg.to(obj.dtype))


def add_grad(p: Tensor, g: Tensor) -> None:
    g = g.to(p.dtype)
    if p.grad is None:
        p.grad = g.contiguous() if g.is_contiguous() else g.clone(memory_format=torch.contiguous_format)
    else:
        p.grad.add_(g)
