"""The task Gramian per layer, from a layer's saved input and its k output gradients, and
the weighted update ``sum_i w_i g_i`` written from the same pieces (``stage``'s steps 2 and 3).

A Linear's task gradients are ``b_i^T a``; the Gramian is either ``b_i^T (a a^T) b_j``
(the Gram of the rows, when the rows are fewer than the features), or those task gradients
are formed once, whichever costs fewer flops (``gram_pays``): then the Gramian and the update
both come from them. A Conv's weight is small and its activations large: its k weight
gradients are formed once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


@dataclass
class Layer:
    """A Linear or Conv (groups 1) whose weight and bias a rule owns: answered from (a, b)."""

    module: nn.Module
    rule: Any  # the LossRule that owns it
    names: set[str]  # of "weight", "bias"
    calls: list[tuple[Tensor, Any]] = field(default_factory=list)  # (input, output's gradient edge)


def linear_rows(m: nn.Module, x: Tensor) -> Tensor:
    """A Linear's input as rows ``[N, features]``: the weight gradient is ``b^T a``."""
    return x.reshape(-1, x.shape[-1])


def out_rows(m: nn.Module, g: Tensor) -> Tensor:
    """A Linear's output gradients ``[k, ..., out]`` as ``[k, N, out]``, rows matching ``_rows``."""
    return g.reshape(g.shape[0], -1, g.shape[-1])


def conv_input(m: nn.Module, x: Tensor) -> Tensor:
    """The input as the convolution saw it, padded (so any padding mode or string works)."""
    pad = m._reversed_padding_repeated_twice
    if any(pad):
        x = F.pad(x, pad, mode="constant" if m.padding_mode == "zeros" else m.padding_mode)
    return x


def conv_weight_grads(m: nn.Module, x: Tensor, g: Tensor) -> Tensor:
    """``[k, *weight]``: the weight gradient of each of the k output gradients ``g`` (torch's
    own convolution backward, no patches formed); the weights of a Conv are small."""
    d, w = x.dim() - 2, m.weight.to(x.dtype)

    def one(gi: Tensor) -> Tensor:
        return torch.ops.aten.convolution_backward(
            gi, x, w, None, m.stride, [0] * d, m.dilation, False, [0] * d, m.groups, [False, True, False]
        )[1]

    return torch.vmap(one)(g)


def gram_pays(n: int, d_in: int, d_out: int, k: int) -> bool:
    """Row Gram (``n^2 (d_in + k d_out)``) against k weight gradients (``k n d_in d_out``)."""
    return n * (d_in + k * d_out) < k * d_in * d_out


def entries(parts: list) -> list[tuple]:
    """One entry per tensor the rule answers for: a layer called several times in the
    forward answers once (its task gradient is the sum over the calls). Half-precision
    gradients are taken in float32 (the Gramian's sums need the range)."""
    linear: dict[int, tuple] = {}
    conv: dict[int, tuple] = {}
    out = []
    for (_, what, obj), g in parts:
        g = g.float() if g.dtype in (torch.float16, torch.bfloat16) else g
        if what != "layer":
            out.append((what, obj, g))
            continue
        layer, a = obj
        m = layer.module
        if isinstance(m, CONVS):
            conv.setdefault(id(layer), ("conv", layer, []))[2].append((conv_input(m, a.to(g.dtype)), g))
        else:
            entry = linear.setdefault(id(layer), ("linear", layer, [], []))
            entry[2].append(linear_rows(m, a).to(g.dtype))
            entry[3].append(out_rows(m, g))
    rows = [e for _, layer, A, B in linear.values() for e in linear_entries(layer, _cat(A, 0), _cat(B, 1))]
    # A Conv's weight is small and its activations large: its k weight gradients, once.
    convs = [("param", obj, g.view(g.shape[0], *obj.shape)) for e in conv.values() for _, obj, g in conv_pieces(e)]
    return rows + convs + out


def linear_entries(layer: Layer, A: Tensor, B: Tensor) -> list[tuple]:
    """The layer answered from (a, b) while the rows' Gram pays, else its k task gradients
    formed here, once: the Gramian and the update then read them (no second weight matmul)."""
    if "weight" not in layer.names or gram_pays(A.shape[0], A.shape[1], B.shape[2], B.shape[0]):
        return [("linear", layer, A, B)]
    return [("param", p, g.view(g.shape[0], *p.shape)) for _, p, g in pieces(("linear", layer, A, B))]


def _cat(parts: list[Tensor], dim: int) -> Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)  # one call: no copy


def gram(e: tuple) -> Tensor:
    """The entry's part of the Gramian of the task gradients, ``[k, k]``."""
    if e[0] == "linear":
        _, layer, A, B = e
        k = B.shape[0]
        G = B.new_zeros(k, k)
        if "weight" in layer.names:  # the rows' Gram (linear_entries chose it)
            KB = torch.matmul(A @ A.T, B)  # [k, N, out]
            G = G + B.flatten(1) @ KB.flatten(1).T
        if "bias" in layer.names:
            s = B.sum(1)
            G = G + s @ s.T
        return G
    f = e[2].flatten(1)
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
    return [(e[0], e[1], e[2].flatten(1))]


def conv_pieces(e: tuple) -> list[tuple[str, Tensor, Tensor]]:
    """A Conv's k weight (and bias) gradients, each summed over the layer's calls."""
    _, layer, calls = e
    m = layer.module
    out = []
    if "weight" in layer.names:
        out.append(("param", m.weight, sum(conv_weight_grads(m, x, g) for x, g in calls).flatten(1)))
    if "bias" in layer.names:
        out.append(("param", m.bias, sum(g.flatten(3).sum((1, 3)) for _, g in calls)))
    return out


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
        else:
            replace[id(obj)] = (obj, agg)


def add_grad(p: Tensor, g: Tensor) -> None:
    g = g.to(p.dtype)
    if p.grad is None:
        p.grad = g.contiguous() if g.is_contiguous() else g.clone(memory_format=torch.contiguous_format)
    else:
        p.grad.add_(g)
