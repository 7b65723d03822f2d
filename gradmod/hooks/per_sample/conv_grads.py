"""Each example's weight gradient of a convolution, by torch's own weight-gradient kernel.

The batch becomes the groups of one convolution: the input ``[B, C, *S]`` as ``[1, B C, *S]``,
the output gradient ``[B, O, *S']`` as ``[1, B O, *S']``, ``B x groups`` groups; the weight
gradient of that convolution, ``[B O, C / groups, *K]``, is every example's own. No unfolded
copy of the input is formed (``[B, C K, L]``, the cost of the patches' path), and the kernel is
the one autograd uses for the batch's weight gradient.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def per_example_weight(m: nn.Module, a: Tensor, b: Tensor) -> Tensor:
    """``[B, *m.weight.shape]``: example i's gradient of ``m.weight`` from its input ``a[i]``
    and output gradient ``b[i]``."""
    bsz, padding = a.shape[0], m.padding
    if m.padding_mode != "zeros" or isinstance(padding, str):  # "same" may pad unevenly: pad, then none
        mode = "constant" if m.padding_mode == "zeros" else m.padding_mode
        a, padding = F.pad(a, m._reversed_padding_repeated_twice, mode=mode), [0] * (a.dim() - 2)
    weight: Any = m.weight
    shape = (bsz * weight.shape[0], *weight.shape[1:])  # the kernel reads the weight's shape only
    grads = torch.ops.aten.convolution_backward(
        b.reshape(1, -1, *b.shape[2:]),
        a.reshape(1, -1, *a.shape[2:]),
        weight.new_empty(shape, dtype=b.dtype),
        None,
        m.stride,
        padding,
        m.dilation,
        False,
        [0] * (a.dim() - 2),
        bsz * m.groups,
        [False, True, False],
    )[1]
    return grads.reshape(bsz, *weight.shape)
