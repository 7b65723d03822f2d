"""Per-example gradients of one layer from its saved input ``a`` and output gradient ``b``.

Each form answers three questions about the parameters (local names) it is asked for:
``norms2`` (each example's squared gradient norm, ``[B]``), ``weighted`` (``sum_i w_i g_i``,
the clipped sum as one matmul) and ``per_example`` (``[B, *param]``, only where a parameter
needs it: a layer called twice in one forward, or weights shared between layers).
Linear, Conv and Embedding compute norms without materialising ``[B, *param]`` where that
pays ("ghost" norms: ``|a_i||b_i|`` for a Linear on 2-D input, Gram matrices for sequences
and convolutions); RNNs replay their recurrence once for the gates' gradients; any other
module goes through ``torch.func`` (vmap of its vjp). A form sees its input and output
gradient with the batch first (the stage moves it there, from the dimension its trace of
the first forward found); a ``whole_call`` form gets every input and output gradient.
``register_form(layer_type, form)`` adds a form for a layer type of a user's own
(``form.Form`` is their base; ``recurrent`` holds the RNNs' form).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from gradmod.hooks.per_sample.forms.attention import AttentionForm
from gradmod.hooks.per_sample.forms.base import Form, broadcast_weights
from gradmod.hooks.per_sample.forms.conv_grads import (
    gram_pays,
    output_grads,
    patches,
    per_example_weight,
    weight_grad,
    weight_norms2,
)
from gradmod.hooks.per_sample.forms.recurrent import RNNForm
from gradmod.hooks.per_sample.forms.replay import FuncForm

# Elements of a [B, *param] tensor worth keeping during one backward: below this the
# per-example weights (one matmul; norms and the weighted sum are then cheap) beat
# Gram-matrix norms plus a second matmul for the weighted sum; above it, memory decides.
MATERIALISE_MAX = 1 << 24
# A pass over one element of [B, *param] costs about as much as this many multiply-adds of
# a Gram matrix (memory against arithmetic, measured on resnet18's convolutions on a CPU).
GRAM_MARGIN = 8
# Up to this many output positions a convolution's clipped sum is one matmul of its unfolded
# input (torch's weight-gradient kernel is slow on tiny outputs); above, that kernel.
FEW_POSITIONS = 4


def _seq(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """Input and output gradient as ``[B, T, features]`` (T = 1 for 2-D inputs)."""
    return a.reshape(a.shape[0], -1, a.shape[-1]), b.reshape(b.shape[0], -1, b.shape[-1])


def _small(bsz: int, m: nn.Module) -> bool:
    return bsz * m.weight.numel() <= MATERIALISE_MAX


class LinearForm(Form):
    fresh = True
    detaches = True  # runs on detached aliases after the first backward (``detached_weights``)
    second_order = True

    def add_per_example(self, m, a, b, names, into):
        if "weight" not in into:
            return super().add_per_example(m, a, b, names, into)
        A, G = _seq(a, b)
        return {
            **super().add_per_example(m, a, b, names - {"weight"}, into),
            "weight": into["weight"].baddbmm_(G.mT, A),
        }

    def materialises(self, m, a, b):
        """On sequences, where the per-example weights are small and cost fewer flops than the
        Gram matrices (on 2-D input |a_i||b_i| is cheaper); either way the clipped sum costs
        one matmul as large as the weight gradient autograd is spared (``detached_weights``)."""
        A, G = _seq(a, b)
        return a.dim() > 2 and _small(len(a), m) and not gram_pays(A.shape[1], A.shape[2], G.shape[2])

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
            elif gram_pays(A.shape[1], A.shape[2], G.shape[2]):
                out["weight"] = (torch.bmm(A, A.mT) * torch.bmm(G, G.mT)).sum((1, 2))
            else:
                out["weight"] = torch.bmm(G.mT, A).square().sum((1, 2))
        if "bias" in names:
            out["bias"] = G.sum(1).square().sum(1)
        return out

    def weighted(self, m, a, b, w, names):
        out = {}
        G = (b * broadcast_weights(w, b)).reshape(-1, b.shape[-1])
        if "weight" in names:
            out["weight"] = G.T @ a.reshape(-1, a.shape[-1])
        if "bias" in names:
            out["bias"] = G.sum(0)
        return out


class ConvForm(Form):
    """Conv1d/2d/3d: the input unfolded into patches ``[B, groups, L, C_g * K]``, the output
    gradient as ``[B, groups, O_g, L]``; the weight gradient of example i is their product."""

    detaches = True
    second_order = True

    def materialises(self, m, a, b):
        """Where the per-example weights are small and the Gram matrices would not cost less:
        ``L^2 (C_g K + O_g)`` against ``L C_g K O_g`` plus three passes over ``[B, *param]`` (to
        form it, norm it, sum it), worth about ``GRAM_MARGIN`` products an element."""
        positions, taps, outs = math.prod(b.shape[2:]), m.weight[0].numel(), m.weight.shape[0] // m.groups
        return _small(len(b), m) and positions * positions * (taps + outs) >= GRAM_MARGIN * taps * outs

    def per_example(self, m, a, b, names):
        out = {}
        G = output_grads(m, b)
        if "weight" in names:
            out["weight"] = per_example_weight(m, a, b)
        if "bias" in names:
            out["bias"] = G.sum(3).flatten(1)
        return out

    def norms2(self, m, a, b, names):
        out = {}
        G = output_grads(m, b)
        if "weight" in names:
            out["weight"] = weight_norms2(m, a, b)
        if "bias" in names:
            out["bias"] = G.sum(3).square().sum((1, 2))
        return out

    def weighted(self, m, a, b, w, names):
        out = {}
        bw = b * broadcast_weights(w, b)
        if "weight" in names:
            if math.prod(b.shape[2:]) <= FEW_POSITIONS:  # patches as small as the input: one matmul
                G, P = output_grads(m, bw), patches(m, a)
                # sum over examples and positions: [g, O_g, B*L] @ [g, B*L, C_g*K]
                out["weight"] = torch.einsum("bgol,bgkl->gok", G, P).reshape(m.weight.shape)
            else:  # torch's own weight-gradient kernel, on the weighted output gradient
                out["weight"] = weight_grad(m, a, bw)
        if "bias" in names:
            out["bias"] = bw.sum((0, *range(2, b.dim())))
        return out


def _affine(b: Tensor, xhat: Tensor, dims: tuple[int, ...], names: set[str]) -> dict[str, Tensor]:
    """Per-example weight (``sum b * xhat``) and bias (``sum b``) over ``dims``: every dim
    that is neither the batch nor a parameter dim."""
    out = {}
    if "weight" in names:
        out["weight"] = (b * xhat).sum(dims) if dims else b * xhat
    if "bias" in names:
        out["bias"] = b.sum(dims) if dims else b
    return out


class LayerNormForm(Form):
    def per_example(self, m, a, b, names):
        xhat = F.layer_norm(a, m.normalized_shape, eps=m.eps)
        return _affine(b, xhat, tuple(range(1, b.dim() - len(m.normalized_shape))), names)  # the trailing dims stay


class GroupNormForm(Form):
    def per_example(self, m, a, b, names):
        xhat = F.group_norm(a, m.num_groups, eps=m.eps)
        out = _affine(b, xhat, tuple(range(2, b.dim())), names - {"weight"})  # channels are dim 1
        if "weight" in names:  # sum_s b * xhat as one batched product: no [B, C, *S] temporary
            out["weight"] = torch.einsum("bcs,bcs->bc", b.reshape(*b.shape[:2], -1), xhat.reshape(*b.shape[:2], -1))
        return out


class EvalBatchNormForm(Form):
    """BatchNorm on its running statistics (eval mode): an affine map of each example alone. Not in
    ``FORMS``: a BatchNorm that trains normalises by the batch, mixing its examples (DP-SGD's stage
    refuses it); influence, which reads models in eval mode, takes it."""

    def per_example(self, m, a, b, names):
        xhat = F.batch_norm(a, m.running_mean, m.running_var, None, None, False, 0.0, m.eps)
        return _affine(b, xhat, tuple(range(2, b.dim())), names)  # channels are dim 1


class ScaleNormForm(Form):
    """A norm whose output is ``weight * normalised(x)``, no bias (RMSNorm: torch's, Llama's,
    T5's): ``normalised(x)`` is the module's own forward with the weight set to ones, so its
    dtype steps (Hugging Face's float32 variance) are the module's."""

    @staticmethod
    def normalised(m: nn.Module, a: Tensor) -> Tensor:
        with torch.no_grad():  # no graph, and no call the stage would follow
            return functional_call(m, {"weight": torch.ones_like(m.weight)}, (a,))

    def per_example(self, m, a, b, names):
        return _affine(b, self.normalised(m, a), tuple(range(1, b.dim() - m.weight.dim())), names)


class EmbeddingForm(Form):
    """Rows gathered by index: the gradient of example i adds ``b_it`` to row ``idx_it``."""

    detaches = True  # runs on detached aliases after the first backward (``detached_weights``)

    fresh = True

    def refusal(self, m):
        if m.max_norm is not None:
            return "max_norm (its forward rescales the rows the whole batch looked up, in place)"
        return None

    def materialises(self, m, a, b):
        """Where the table is smaller than the tokens' Gram matrix (T5's bias: 32 rows, T^2 lookups)."""
        positions = a[0].numel() if len(a) else 0
        return _small(len(a), m) and positions * positions > m.weight.numel()

    @staticmethod
    def _flat(m, idx: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
        idx = idx.reshape(idx.shape[0], -1)
        b = b.reshape(idx.shape[0], -1, b.shape[-1])
        if m.padding_idx is not None:  # torch gives the padding row no gradient
            b = b * (idx != m.padding_idx).unsqueeze(-1).to(b.dtype)
        return idx, b

    def per_example(self, m, a, b, names):
        return self.add_per_example(m, a, b, names, {})

    def add_per_example(self, m, a, b, names, into):
        idx, G = self._flat(m, a, b)
        out = into["weight"] if "weight" in into else G.new_zeros(idx.shape[0], *m.weight.shape)
        return {"weight": out.scatter_add_(1, idx.unsqueeze(-1).expand_as(G), G)}

    def norms2(self, m, a, b, names):
        idx, G = self._flat(m, a, b)
        same = (idx.unsqueeze(2) == idx.unsqueeze(1)).to(G.dtype)  # tokens that share a row
        return {"weight": (same * (G @ G.mT)).sum((1, 2))}

    def weighted(self, m, a, b, w, names):
        idx, G = self._flat(m, a, b)
        out = G.new_zeros(m.weight.shape)
        return {"weight": out.index_add_(0, idx.flatten(), (G * broadcast_weights(w, G)).flatten(0, 1))}


class Conv1DForm(Form):
    """Hugging Face's ``Conv1D``: a Linear whose weight is stored ``[in, out]``."""

    detaches = True  # runs on detached aliases after the first backward (``detached_weights``)
    second_order = True

    def materialises(self, m, a, b):
        return LINEAR.materialises(m, a, b)

    def per_example(self, m, a, b, names):
        out = LINEAR.per_example(m, a, b, names - {"weight"})
        if "weight" in names:  # [B, in, out] as stored, contiguous: norms and sums read it in one pass
            A, G = _seq(a, b)
            out["weight"] = torch.bmm(A.mT, G)
        return out

    def norms2(self, m, a, b, names):
        return LINEAR.norms2(m, a, b, names)

    def weighted(self, m, a, b, w, names):
        out = LINEAR.weighted(m, a, b, w, names)
        if "weight" in out:
            out["weight"] = out["weight"].T
        return out


LINEAR, CONV, FUNC, RNN, SCALE_NORM = LinearForm(), ConvForm(), FuncForm(), RNNForm(), ScaleNormForm()
FORMS: dict[type, Form] = {
    nn.Linear: LINEAR,
    nn.Conv1d: CONV,
    nn.Conv2d: CONV,
    nn.Conv3d: CONV,
    nn.LayerNorm: LayerNormForm(),
    nn.GroupNorm: GroupNormForm(),
    nn.RMSNorm: SCALE_NORM,
    nn.Embedding: EmbeddingForm(),
    nn.RNN: RNN,
    nn.LSTM: RNN,
    nn.GRU: RNN,
    nn.MultiheadAttention: AttentionForm(),
}
# Forms of other libraries' layers, found by the type's module and name (nothing imported).
# Hugging Face's RMSNorms that return ``self.weight * normalised(x)`` (Gemma's ``1 + weight`` does not).
NAMED_FORMS: dict[tuple[str, str], Form] = {
    ("transformers.pytorch_utils", "Conv1D"): Conv1DForm(),
    **{
        (f"transformers.models.{model}.modeling_{model}", name): SCALE_NORM
        for model, name in (
            ("llama", "LlamaRMSNorm"),
            ("mistral", "MistralRMSNorm"),
            ("mixtral", "MixtralRMSNorm"),
            ("qwen2", "Qwen2RMSNorm"),
            ("qwen3", "Qwen3RMSNorm"),
            ("t5", "T5LayerNorm"),
            ("mt5", "MT5LayerNorm"),
        )
    },  # fmt: skip
}


def register_form(layer_type: type, form: Form | None = None):
    """Make ``form`` (a ``Form`` instance) the per-example form of ``layer_type`` and of its
    subclasses that keep its ``forward``. Usable as a decorator of a Form subclass:
    ``@register_form(MyLayer)``. The form must answer for every parameter the layer holds
    directly; uses of them outside ``layer_type.forward`` go to the general path."""
    if not (isinstance(layer_type, type) and issubclass(layer_type, nn.Module)):
        raise TypeError(f"register_form: layer_type must be an nn.Module subclass, not {layer_type!r}")
    if form is None:

        def decorate(cls):
            register_form(layer_type, cls())
            return cls

        return decorate
    if not isinstance(form, Form):
        raise TypeError(
            f"register_form: form must be a gradmod.hooks.per_sample.Form instance, not {type(form).__name__}"
        )
    FORMS[layer_type] = form
    return form


def batch_dependent(m: nn.Module) -> bool:
    """A layer whose batch gradient is not the sum of its examples' (so no sum can check them)."""
    return isinstance(m, nn.Embedding) and m.scale_grad_by_freq


def form_of(m: nn.Module) -> Form:
    """The closed form for ``m``'s type when ``m`` runs that type's own forward, else ``torch.func``."""
    named = NAMED_FORMS.get((type(m).__module__, type(m).__name__))
    if named is not None:
        return named
    for cls in reversed(list(FORMS)):  # the latest registration first: a user's form wins
        if isinstance(m, cls) and type(m).forward is cls.forward:
            if isinstance(m, nn.Embedding) and (m.scale_grad_by_freq or m.sparse):
                return FUNC
            return FORMS[cls] if FORMS[cls].applies(m) else FUNC
    return FUNC
