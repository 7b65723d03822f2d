"""Each example's weight gradient of a convolution, and its squared norm, at the lower cost.

Per-example weights: with many channels per group, torch's own weight-gradient kernel on the
batch as the groups of one convolution (the input ``[B, C, *S]`` as ``[1, B C, *S]``, the
output gradient as ``[1, B O, *S']``, ``B x groups`` groups; its weight gradient
``[B O, C / groups, *K]`` is every example's own); with few (an image's 1 or 3), where that
kernel is slow, one batched matmul of the output gradient and the unfolded input (while that
stays small).

Norms: example i's squared weight-gradient norm is ``sum_{t,s} (P_t . P_s)(G_t . G_s)`` over
its output positions (its input patches P, output gradients G): Gram matrices of ``L^2 (d + p)``
products against ``L d p`` for the per-example weight (L positions, d = C_g K, p = O_g); the
cheaper one is taken. The Gram matrices read the patches laid out channels last: one copy
that moves whole runs of channels, a fraction of the cost of the positions-last layout.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gradmod.hooks.per_sample.forms.base import rows_norm2

# Below this many input channels per group the grouped kernel is slower than the matmul of
# the unfolded input (measured on a CPU: 1 and 3 channels slower, 32 and 64 faster).
FEW_CHANNELS = 8
# Elements of the unfolded input that matmul may form (K / stride^2 times the input: an
# ImageNet batch's first convolution takes the grouped kernel, which unfolds nothing).
PATCHES_MAX = 1 << 24


def gram_pays(positions: int, d_in: int, d_out: int) -> bool:
    """Gram matrices (``T^2 (d_in + d_out)``) cost less than the per-example weight (``T d_in d_out``)."""
    return positions * (d_in + d_out) < d_in * d_out


def _padded(m: nn.Module, x: Tensor) -> Tensor:
    pad = m._reversed_padding_repeated_twice
    if any(pad):
        x = F.pad(x, pad, mode="constant" if m.padding_mode == "zeros" else m.padding_mode)
    return x


def _windows(m: nn.Module, x: Tensor, first: int) -> Tensor:
    """Each spatial dim (from ``first``) -> (windows, kernel taps), the taps appended last:
    ``Tensor.unfold`` (faster than im2col on a CPU, any dimension and padding mode)."""
    for i in range(len(m.kernel_size)):
        k, s, dil = m.kernel_size[i], m.stride[i], m.dilation[i]
        x = x.unfold(first + i, dil * (k - 1) + 1, s)
        if dil > 1:
            x = x[..., ::dil]
    return x


def patches(m: nn.Module, x: Tensor) -> Tensor:
    """``[B, groups, C_g * K, L]``: each output position's input patch in the weight's order
    (channel, then taps), positions last."""
    d = x.dim() - 2
    x = _windows(m, _padded(m, x), 2)  # [B, C, *L, *K]
    length = math.prod(x.shape[2 : 2 + d])
    return x.permute(0, 1, *range(2 + d, 2 + 2 * d), *range(2, 2 + d)).reshape(len(x), m.groups, -1, length)


def patches_last(m: nn.Module, x: Tensor) -> Tensor:
    """``[B, groups, L, K * C_g]``: the patches with the channels innermost (taps, then channel)."""
    d, c_g = x.dim() - 2, x.shape[1] // m.groups
    x = _windows(m, _padded(m, x).movedim(1, -1).contiguous(), 1)  # [B, *L, C, *K]
    x = x.movedim(1 + d, -1)  # [B, *L, *K, C]: whole runs of C copied at once
    length = math.prod(x.shape[1 : 1 + d])
    x = x.reshape(len(x), length, -1, m.groups, c_g)
    return x.permute(0, 3, 1, 2, 4).reshape(len(x), m.groups, length, -1)


def output_grads(m: nn.Module, b: Tensor) -> Tensor:
    return b.reshape(b.shape[0], m.groups, b.shape[1] // m.groups, -1)  # [B, g, O_g, L]


def per_example_weight(m: nn.Module, a: Tensor, b: Tensor) -> Tensor:
    """``[B, *m.weight.shape]``: example i's gradient of ``m.weight`` from its input ``a[i]``
    and output gradient ``b[i]``."""
    weight: Any = m.weight
    unfolded = len(a) * math.prod(weight.shape[1:]) * m.groups * math.prod(b.shape[2:])
    if a.shape[1] // m.groups < FEW_CHANNELS and unfolded <= PATCHES_MAX:  # ([B,g,C_g K,L] @ [B,g,L,O_g])^T
        return (patches(m, a) @ output_grads(m, b).mT).mT.reshape(len(a), *weight.shape)
    bsz = a.shape[0]
    shape = (bsz * weight.shape[0], *weight.shape[1:])  # the kernel reads the weight's shape only
    grads = weight_grad(
        m,
        a.reshape(1, -1, *a.shape[2:]),
        b.reshape(1, -1, *b.shape[2:]),
        weight=weight.new_empty(shape, dtype=b.dtype),
        groups=bsz * m.groups,
    )
    return grads.reshape(bsz, *weight.shape)


def weight_grad(m: nn.Module, a: Tensor, b: Tensor, weight: Tensor | None = None, groups: int | None = None) -> Tensor:
    """The weight gradient of ``m``'s convolution of ``a`` given the output gradient ``b`` (summed
    over the batch), by the kernel autograd uses; padding other than zeros applied first.
    ``weight``, ``groups``: another convolution's (the batch as groups: each example's own)."""
    padding: Any = m.padding
    if m.padding_mode != "zeros" or isinstance(padding, str):  # "same" may pad unevenly: pad, then none
        a, padding = _padded(m, a), [0] * (a.dim() - 2)
    zeros = [0] * (a.dim() - 2)
    weight = m.weight if weight is None else weight
    groups = m.groups if groups is None else groups
    return torch.ops.aten.convolution_backward(
        b, a, weight, None, m.stride, padding, m.dilation, False, zeros, groups, [False, True, False]
    )[1]


def weight_norms2(m: nn.Module, a: Tensor, b: Tensor) -> Tensor:
    """``[B]``: each example's squared norm of its gradient of ``m.weight``, by Gram matrices of
    its positions where they cost less than its per-example weight."""
    positions, taps, outs = math.prod(b.shape[2:]), m.weight[0].numel(), m.weight.shape[0] // m.groups
    return gram_norms2(m, a, b) if gram_pays(positions, taps, outs) else rows_norm2(per_example_weight(m, a, b))


def gram_norms2(m: nn.Module, a: Tensor, b: Tensor) -> Tensor:
    """``[B]``: ``sum_{t,s} (P_t . P_s)(G_t . G_s)`` per example, summed over the groups."""
    G, P = output_grads(m, b), patches_last(m, a)
    return ((P @ P.mT) * (G.mT @ G)).sum((1, 2, 3))
