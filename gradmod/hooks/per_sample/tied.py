"""Weights shared between calls (a tied embedding and ``lm_head``, a layer called twice) without
per-example tensors, where every use is a Linear's or an Embedding's weight and that pays
(short sequences, or a per-example weight too large to keep: a real vocabulary).

Example i's gradient of such a weight is the sum of its calls' ``g_ki``, so its squared norm is
``sum_k |g_ki|^2 + 2 sum_{k<l} <g_ki, g_li>``: each call's own term is its Gram norm (as for an
unshared layer), and each cross term comes from the two calls' inputs and output gradients:
two Linears ``sum (A_k A_l^T) * (G_k G_l^T)``; two Embeddings ``sum [idx_k == idx_l] * (E_k E_l^T)``;
an Embedding and a Linear (its rows the vocabulary) ``sum (A E^T) * G[:, :, idx]``. That costs
``[B, T, T]`` matrices where the per-example weight would be ``[B, vocab, d]``; the clipped sum
is then each call's weighted matmul or index_add.
"""

from __future__ import annotations

from itertools import combinations

import torch
from torch import Tensor

from gradmod.hooks.per_sample.forms.layers import MATERIALISE_MAX, EmbeddingForm, LinearForm, _seq

FORMS = (LinearForm, EmbeddingForm)


def shared(calls: list) -> set[int]:
    """ids of the parameters several calls use, every use a Linear's or an Embedding's weight,
    whose calls need no per-example tensors for another shared parameter."""
    uses: dict[int, list] = {}
    for c in calls:
        for n, p in c.names.items():
            uses.setdefault(id(p), []).append((c, n))
    many = {i for i, u in uses.items() if len(u) > 1}
    found = {
        i
        for i in many
        if all(n == "weight" and type(c.layer.form) in FORMS for c, n in uses[i])
        or all(n == "bias" and type(c.layer.form) is LinearForm for c, n in uses[i])
    }
    found = {i for i in found if _pays([c for c, _ in uses[i]])}
    while True:  # a call that also uses a shared parameter outside ``found`` forms its tensors anyway
        drop = {i for i in found for c, _ in uses[i] if any(id(q) in many - found for q in c.names.values())}
        if not drop:
            return found
        found -= drop


def _pays(calls: list) -> bool:
    """Gram matrices cost less than the per-example weight (``[B, vocab, d]``, and its passes to
    fill, add up and read back), or that tensor is too large to keep."""
    if "weight" not in calls[0].layer.names:  # biases alone: their cross terms are [B] dots
        return True
    weight = calls[0].layer.names["weight"]
    if len(calls[0].inputs) * weight.numel() > MATERIALISE_MAX:
        return True
    for c in calls:
        positions = c.inputs[0].numel() // (c.inputs.shape[-1] if isinstance(c.layer.form, LinearForm) else 1)
        width = sum(weight.shape) if isinstance(c.layer.form, LinearForm) else weight.shape[1] + 1
        if 2 * positions * width >= weight.numel():  # the Gram's T^2 (d_in + d_out) against T d_in d_out / 2
            return False
    return True


def _operands(c, b: Tensor, name: str) -> tuple[str, Tensor, Tensor]:
    if name == "bias":
        return "bias", b, b.reshape(b.shape[0], -1, b.shape[-1]).sum(1)
    if isinstance(c.layer.form, EmbeddingForm):
        idx, grads = EmbeddingForm._flat(c.layer.module, c.inputs, b)
        return "embedding", idx, grads
    a, g = _seq(c.inputs, b)
    return "linear", a, g


def _dot(x: tuple, y: tuple) -> Tensor:
    """``<g_x, g_y>`` per example, from two calls' operands."""
    if x[0] == "embedding" and y[0] == "linear":
        x, y = y, x
    kind_x, a, g = x
    kind_y, c, e = y
    if kind_x == "bias":
        return (g * e).sum(1)
    if kind_x == "linear" and kind_y == "linear":
        return ((a @ c.mT) * (g @ e.mT)).sum((1, 2))
    if kind_x == "embedding":  # both embeddings: a, c are ids
        same = (a.unsqueeze(2) == c.unsqueeze(1)).to(g.dtype)
        return (same * (g @ e.mT)).sum((1, 2))
    # a Linear (inputs a, output gradients g over the vocabulary) and an Embedding (ids c, gradients e)
    rows = g.gather(2, c.unsqueeze(1).expand(-1, g.shape[1], -1))
    return ((a @ e.mT) * rows).sum((1, 2))


def cross_norms2(param: int, calls: list[tuple], dtype: torch.dtype) -> Tensor:
    """``2 sum_{k<l} <g_k, g_l>`` per example over the ``calls`` ((call, output gradient)) of ``param`` (its id)."""
    ops = [_operands(c, b, n) for c, b in calls for n, p in c.names.items() if id(p) == param]
    return sum((2 * _dot(x, y).to(dtype) for x, y in combinations(ops, 2)), torch.zeros((), dtype=dtype))
