"""Every gradient accounted for, at every backward, cheaply: each parameter's gradient seen
along one fixed random direction R (rank one for a matrix: ``u v^T``).

The first backward checks whole gradients (the followed calls' sum against autograd's). A use
that starts later (a parameter used functionally, or in the loss, from step k on) would escape
that check, so every later backward compares two scalars per parameter: ``<g, R>`` of the
gradient autograd gives it (one dot in the parameter's hook) and ``sum_i <g_i, R>`` of the
per-example gradients the stage followed, computed from a call's input and output gradient
without forming ``g_i`` (a rank-one ``R`` turns a Linear's ``sum_t (u . b_t)(v . a_t)`` into two
matrix-vector products). A use outside the followed calls adds ``<e, R>`` to one side only:
nonzero for any ``e`` but a set of measure zero of directions. Layers without a probe here
(a registered form that answers without per-example tensors) are checked at the first backward only.
A weight whose calls give its gradient themselves (``detached_weights.hang``) needs no probe where the
gradient autograd hands over is the one tensor its call gave: nothing else reached it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gradmod.hooks.per_sample.forms import attention
from gradmod.hooks.per_sample.forms import layers as L

Probe = tuple[Tensor, ...]  # (u, v): R = u v^T over (dim 0, the rest); (r,): R = r


def probe_for(p: Tensor, seed: int) -> Probe:
    g = torch.Generator().manual_seed(seed)
    dims = [p.shape[0], p[0].numel()] if p.dim() >= 2 else [p.shape]
    return tuple(torch.randn(d, generator=g, dtype=torch.float64).to(p.device, p.dtype) for d in dims)


def dense(probe: Probe, shape: torch.Size) -> Tensor:
    """``R`` itself (small parameters only: a norm's weight)."""
    return (probe[0][:, None] * probe[1][None]).reshape(shape) if len(probe) == 2 else probe[0].reshape(shape)


def probe_dot(g: Tensor, probe: Probe) -> Tensor:
    """``<g, R>``; ``g`` may carry a leading batch dim (summed)."""
    if len(probe) == 2:
        u, v = probe
        # one pass over g, in whatever layout it has (a transposed per-example weight stays as is)
        g3 = g if g.dim() == 3 and g.shape[1:] == (len(u), len(v)) else g.reshape(-1, len(u), len(v))
        return torch.matmul(g3, v.to(g.dtype)).sum(0) @ u.to(g.dtype)
    return (g * probe[0].to(g.dtype)).sum()


def probe_norm(probe: Probe) -> Tensor:
    return torch.stack([x.norm() for x in probe]).prod()


def _linear(m, a, b, probes, names):
    A, G = L._seq(a, b)
    out = {}
    if "weight" in names:
        u, v = probes["weight"]
        out["weight"] = ((G @ u.to(G.dtype)) * (A @ v.to(A.dtype))).sum()
    if "bias" in names:
        out["bias"] = (G @ probes["bias"][0].to(G.dtype)).sum()
    return out


def _conv1d_hf(m, a, b, probes, names):  # weight stored [in, out]: u over inputs, v over outputs
    A, G = L._seq(a, b)
    out = {}
    if "weight" in names:
        u, v = probes["weight"]
        out["weight"] = ((A @ u.to(A.dtype)) * (G @ v.to(G.dtype))).sum()
    if "bias" in names:
        out["bias"] = (G @ probes["bias"][0].to(G.dtype)).sum()
    return out


def _conv(m, a, b, probes, names):
    """``sum_l (u . b_l)(V * patch_l)`` per group: V as a one-channel-per-group kernel."""
    out = {}
    spatial = [1] * (b.dim() - 2)
    if "weight" in names:
        u, v = probes["weight"]
        kernel = v.to(a.dtype).view(1, *m.weight.shape[1:]).expand(m.groups, *m.weight.shape[1:])
        q = m._conv_forward(a, kernel.contiguous(), None)  # [B, groups, *L]
        bu = (b * u.to(b.dtype).view(1, -1, *spatial)).view(b.shape[0], m.groups, -1, *b.shape[2:]).sum(2)
        out["weight"] = (bu * q).sum()
    if "bias" in names:
        out["bias"] = (b * probes["bias"][0].to(b.dtype).view(1, -1, *spatial)).sum()
    return out


def _affine(b, xhat, probes, names, shape_w, view):
    out = {}
    if "weight" in names:
        out["weight"] = (b * xhat * dense(probes["weight"], shape_w).to(b.dtype).view(view)).sum()
    if "bias" in names:
        out["bias"] = (b * dense(probes["bias"], shape_w).to(b.dtype).view(view)).sum()
    return out


def _layer_norm(m, a, b, probes, names):
    xhat = F.layer_norm(a, m.normalized_shape, eps=m.eps)
    return _affine(b, xhat, probes, names, m.weight.shape if m.weight is not None else m.bias.shape, m.normalized_shape)


def _group_norm(m, a, b, probes, names):
    xhat = F.group_norm(a, m.num_groups, eps=m.eps)
    return _affine(b, xhat, probes, names, torch.Size([m.num_channels]), (1, -1, *[1] * (b.dim() - 2)))


def _scale_norm(m, a, b, probes, names):
    xhat = L.ScaleNormForm.normalised(m, a)
    return _affine(b, xhat, probes, names, m.weight.shape, m.weight.shape)


def _embedding(m, a, b, probes, names):
    idx, G = L.EmbeddingForm._flat(m, a, b)
    u, v = probes["weight"]
    return {"weight": (u.to(G.dtype)[idx] * (G @ v.to(G.dtype))).sum()}


PROBES: dict[type, Callable] = {
    L.LinearForm: _linear,
    L.Conv1DForm: _conv1d_hf,
    L.ConvForm: _conv,
    L.LayerNormForm: _layer_norm,
    L.GroupNormForm: _group_norm,
    L.ScaleNormForm: _scale_norm,
    L.EmbeddingForm: _embedding,
    attention.AttentionForm: attention.probe,
}


def ghost_probe(
    form: L.Form, m: nn.Module, a, b, probes: dict[str, Probe], names: set[str]
) -> dict[str, Tensor] | None:
    """``sum_i <g_i, R>`` of a call answered without per-example tensors (None: no probe for its form)."""
    fn = PROBES.get(type(form))
    return None if fn is None else fn(m, a, b, probes, names)
