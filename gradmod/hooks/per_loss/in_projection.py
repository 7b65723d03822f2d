"""Self-attention's in-projection taken as three matmuls under a per_loss rule.

Given one tensor as query, key and value, ``nn.MultiheadAttention`` projects it by its whole
``in_proj_weight`` in one matmul and takes q, k and v apart by indexing. The backward of each
index fills a zero buffer of the whole projection and the three are added: three full-size
buffers per task in the stage's backward, about a fifth of a transformer trunk's step. Given
distinct aliases of the tensor, torch's function projects each by its own third of the weight
instead: the same values, and no buffers.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

NAMES = ("query", "key", "value")


def split_in_projections(model: nn.Module, owned: set[int]) -> list[RemovableHandle]:
    """A pre-hook on each MultiheadAttention whose packed ``in_proj_weight`` a rule owns."""
    return [
        m.register_forward_pre_hook(_distinct, with_kwargs=True)
        for m in model.modules()
        if isinstance(m, nn.MultiheadAttention) and m.in_proj_weight is not None and id(m.in_proj_weight) in owned
    ]


def _distinct(module: nn.Module, args: tuple, kwargs: dict):
    """key and value as aliases when they are query (or key) itself, in a forward with grad."""
    if not torch.is_grad_enabled():
        return None
    args = list(args)
    qkv = [args[i] if i < len(args) else kwargs.get(n) for i, n in enumerate(NAMES)]
    if any(t is None for t in qkv):
        return None
    q, k, v = qkv
    if k is q:
        k = k.view_as(k)
    if v is q or v is qkv[1]:
        v = v.view_as(v)
    for i, (n, t) in enumerate(zip(NAMES, (q, k, v))):
        if i < len(args):
            args[i] = t
        else:
            kwargs[n] = t
    return tuple(args), kwargs
