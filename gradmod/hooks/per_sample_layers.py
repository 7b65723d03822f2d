"""Per-example gradients of one layer from its saved input ``a`` and output gradient ``b``.

Each form answers three questions about the parameters (local names) it is asked for:
``norms2`` (each example's squared gradient norm, ``[B]``), ``weighted`` (``sum_i w_i g_i``,
the clipped sum as one matmul) and ``per_example`` (``[B, *param]``, only where a parameter
needs it: a layer called twice in one forward, or weights shared between layers).
Linear, Conv and Embedding compute norms without materialising ``[B, *param]`` where that
pays ("ghost" norms: ``|a_i||b_i|`` for a Linear on 2-D input, Gram matrices for sequences
and convolutions); any other module goes through ``torch.func`` (vmap of its vjp).
The batch is the first dimension of the input and of the output.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap


def _bcast(w: Tensor, like: Tensor) -> Tensor:
    """Per-example weights ``[B]`` shaped to multiply ``like`` (batch first)."""
    return w.view(-1, *[1] * (like.dim() - 1)).to(like.dtype)


# Elements of a [B, *param] tensor worth keeping during one backward: below this the
# per-example weights (one matmul; norms and the weighted sum are then cheap) beat
# Gram-matrix norms plus a second matmul for the weighted sum; above it, memory decides.
MATERIALISE_MAX = 1 << 24


class Form:
    """Defaults from ``per_example``: right for every layer, fast for small parameters."""

    def per_example(self, m: nn.Module, a: Any, b: Tensor, names: set[str]) -> dict[str, Tensor]:
        raise NotImplementedError

    def materialises(self, m: nn.Module, a: Any, b: Tensor) -> bool:
        """Whether ``per_example`` (then norms and the weighted sum from it) is the cheaper way."""
        return True

    def norms2(self, m, a, b, names) -> dict[str, Tensor]:
        return {n: g.flatten(1).square().sum(1) for n, g in self.per_example(m, a, b, names).items()}

    def weighted(self, m, a, b, w: Tensor, names) -> dict[str, Tensor]:
        return {n: torch.tensordot(w.to(g.dtype), g, 1) for n, g in self.per_example(m, a, b, names).items()}


def _seq(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """Input and output gradient as ``[B, T, features]`` (T = 1 for 2-D inputs)."""
    return a.reshape(a.shape[0], -1, a.shape[-1]), b.reshape(b.shape[0], -1, b.shape[-1])


def _gram_pays(t: int, d_in: int, d_out: int) -> bool:
    """Gram matrices (``T^2 (d_in + d_out)``) cost less than the per-example weight (``T d_in d_out``)."""
    return t * (d_in + d_out) < d_in * d_out


def _small(bsz: int, m: nn.Module) -> bool:
    return bsz * m.weight.numel() <= MATERIALISE_MAX


class LinearForm(Form):
    def materialises(self, m, a, b):
        """On sequences, where the per-example weights are small (on 2-D input |a_i||b_i| is cheaper)."""
        return a.dim() > 2 and _small(len(a), m)

    def per_example(self, m, a, b, names):
        A, G = _seq(a, b)
        out = {}
        if "weight" in names:
            out["weight"] = torch.bmm(G.mT, A)
        if "bias" in names:
            out["bias"] = G.sum(1)
        return out

    def norms2(self, m, a, b, names):
        A, G = _seq(a, b)
        out = {}
        if "weight" in names:
            if A.shape[1] == 1:  # |b_i a_i^T| = |a_i| |b_i|
                out["weight"] = A.square().sum((1, 2)) * G.square().sum((1, 2))
            elif _gram_pays(A.shape[1], A.shape[2], G.shape[2]):
                out["weight"] = (torch.bmm(A, A.mT) * torch.bmm(G, G.mT)).sum((1, 2))
            else:
                out["weight"] = torch.bmm(G.mT, A).square().sum((1, 2))
        if "bias" in names:
            out["bias"] = G.sum(1).square().sum(1)
        return out

    def weighted(self, m, a, b, w, names):
        out = {}
        G = (b * _bcast(w, b)).reshape(-1, b.shape[-1])
        if "weight" in names:
            out["weight"] = G.T @ a.reshape(-1, a.shape[-1])
        if "bias" in names:
            out["bias"] = G.sum(0)
        return out


class ConvForm(Form):
    """Conv1d/2d/3d: the input unfolded into patches ``[B, groups, L, C_g * K]``, the output
    gradient as ``[B, groups, O_g, L]``; the weight gradient of example i is their product."""

    @staticmethod
    def _patches(m: nn.Module, x: Tensor) -> Tensor:
        """``[B, groups, C_g * K, L]``: ``Tensor.unfold`` per spatial dimension (faster
        than im2col on a CPU, and any dimension and padding mode)."""
        bsz = x.shape[0]
        d = x.dim() - 2
        pad = m._reversed_padding_repeated_twice
        if any(pad):
            x = F.pad(x, pad, mode="constant" if m.padding_mode == "zeros" else m.padding_mode)
        for i in range(d):  # each spatial dim -> (windows, kernel taps), taps appended last
            k, s, dil = m.kernel_size[i], m.stride[i], m.dilation[i]
            x = x.unfold(2 + i, dil * (k - 1) + 1, s)
            if dil > 1:
                x = x[..., ::dil]
        length = math.prod(x.shape[2:2 + d])
        x = x.permute(0, 1, *range(2 + d, 2 + 2 * d), *range(2, 2 + d)).reshape(bsz, m.groups, -1, length)
        return x

    @staticmethod
    def _grads(m: nn.Module, b: Tensor) -> Tensor:
        return b.reshape(b.shape[0], m.groups, b.shape[1] // m.groups, -1)  # [B, g, O_g, L]

    def materialises(self, m, a, b):
        return _small(len(b), m)

    def per_example(self, m, a, b, names):
        out = {}
        G = self._grads(m, b)
        if "weight" in names:
            P = self._patches(m, a)
            out["weight"] = torch.matmul(G, P.mT).reshape(b.shape[0], *m.weight.shape)
        if "bias" in names:
            out["bias"] = G.sum(3).flatten(1)
        return out

    def norms2(self, m, a, b, names):
        out = {}
        G = self._grads(m, b)
        if "weight" in names:
            P = self._patches(m, a)
            if _gram_pays(P.shape[3], P.shape[2], G.shape[2]):
                out["weight"] = (P.mT @ P * (G.mT @ G)).sum((1, 2, 3))
            else:
                out["weight"] = torch.matmul(G, P.mT).square().sum((1, 2, 3))
        if "bias" in names:
            out["bias"] = G.sum(3).square().sum((1, 2))
        return out

    def weighted(self, m, a, b, w, names):
        out = {}
        G = self._grads(m, b * _bcast(w, b))
        if "weight" in names:
            P = self._patches(m, a)
            # sum over examples and positions: [g, O_g, B*L] @ [g, B*L, C_g*K]
            gw = torch.einsum("bgol,bgkl->gok", G, P)
            out["weight"] = gw.reshape(m.weight.shape)
        if "bias" in names:
            out["bias"] = G.sum((0, 3)).flatten()
        return out


def _affine(b: Tensor, xhat: Tensor, keep: int, names: set[str]) -> dict[str, Tensor]:
    """Per-example weight (``sum b * xhat``) and bias (``sum b``) over every dim that is not
    the batch or one of the ``keep`` parameter dims (last for LayerNorm, 1 for GroupNorm)."""
    out = {}
    if keep == 1:  # GroupNorm: channels are dim 1
        dims = tuple(range(2, b.dim()))
    else:
        dims = tuple(range(1, b.dim() - keep))
    if "weight" in names:
        out["weight"] = (b * xhat).sum(dims) if dims else b * xhat
    if "bias" in names:
        out["bias"] = b.sum(dims) if dims else b
    return out


class LayerNormForm(Form):
    def per_example(self, m, a, b, names):
        xhat = F.layer_norm(a, m.normalized_shape, eps=m.eps)
        return _affine(b, xhat, len(m.normalized_shape), names)


class GroupNormForm(Form):
    def per_example(self, m, a, b, names):
        xhat = F.group_norm(a, m.num_groups, eps=m.eps)
        return _affine(b, xhat, 1, names)


class EmbeddingForm(Form):
    """Rows gathered by index: the gradient of example i adds ``b_it`` to row ``idx_it``."""

    def materialises(self, m, a, b):
        return False

    @staticmethod
    def _flat(m, idx: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
        idx = idx.reshape(idx.shape[0], -1)
        b = b.reshape(idx.shape[0], -1, b.shape[-1])
        if m.padding_idx is not None:  # torch gives the padding row no gradient
            b = b * (idx != m.padding_idx).unsqueeze(-1).to(b.dtype)
        return idx, b

    def per_example(self, m, a, b, names):
        idx, G = self._flat(m, a, b)
        out = G.new_zeros(idx.shape[0], *m.weight.shape)
        out.scatter_add_(1, idx.unsqueeze(-1).expand_as(G), G)
        return {"weight": out}

    def norms2(self, m, a, b, names):
        idx, G = self._flat(m, a, b)
        same = (idx.unsqueeze(2) == idx.unsqueeze(1)).to(G.dtype)  # tokens that share a row
        return {"weight": (same * (G @ G.mT)).sum((1, 2))}

    def weighted(self, m, a, b, w, names):
        idx, G = self._flat(m, a, b)
        out = G.new_zeros(m.weight.shape)
        return {"weight": out.index_add_(0, idx.flatten(), (G * _bcast(w, G)).flatten(0, 1))}


class FuncForm(Form):
    """Any module: ``vmap`` over the batch of the gradient of ``<module(x_i), b_i>`` with
    respect to the module's own selected parameters (``torch.func``). Positional tensor
    inputs whose first dimension is the batch are split per example; the rest is shared."""

    def per_example(self, m, a, b, names):
        args, kwargs = a
        bsz = b[0].shape[0] if isinstance(b, tuple) else b.shape[0]
        grads = b if isinstance(b, tuple) else (b,)
        params = {n: p.detach() for n, p in m.named_parameters(recurse=False) if n in names}
        batched = tuple(0 if isinstance(x, Tensor) and x.dim() > 0 and x.shape[0] == bsz else None for x in args)

        def inner(p, xs, gs):
            xs = tuple(x.unsqueeze(0) if d == 0 else x for x, d in zip(xs, batched))
            out = functional_call(m, p, xs, kwargs)
            outs = out if isinstance(out, (tuple, list)) else (out,)
            outs = [o for o in outs if isinstance(o, Tensor)]
            return sum((o * g.unsqueeze(0)).sum() for o, g in zip(outs, gs) if g is not None)

        return vmap(grad(inner), in_dims=(None, batched, 0))(params, tuple(args), grads)


LINEAR, CONV, FUNC = LinearForm(), ConvForm(), FuncForm()
FORMS: dict[type, Form] = {
    nn.Linear: LINEAR, nn.Conv1d: CONV, nn.Conv2d: CONV, nn.Conv3d: CONV,
    nn.LayerNorm: LayerNormForm(), nn.GroupNorm: GroupNormForm(), nn.Embedding: EmbeddingForm(),
}


def form_of(m: nn.Module) -> Form:
    """The closed form for ``m``'s type when ``m`` runs that type's own forward, else ``torch.func``."""
    for cls, form in FORMS.items():
        if isinstance(m, cls) and type(m).forward is cls.forward:
            if isinstance(m, nn.Embedding) and (m.scale_grad_by_freq or m.sparse):
                return FUNC
            return form
    return FUNC
