"""``torch.optim.Muon`` that also takes convolution kernels.

torch's Muon orthogonalises 2-D parameters only and refuses the rest at construction. A
kernel of shape ``out x in x kh x kw`` is, for Muon, the ``out x (in*kh*kw)`` matrix of its
flattened filters: the reference implementation (KellerJordan/Muon, ``muon_update``) treats
conv filters so. This class gives torch's own step that matrix (a view: the update lands in
the kernel in place) and leaves 2-D parameters exactly to torch's code; the learning-rate
adjustment (``adjust_lr_fn``) reads the shape of the matrix that is orthogonalised.

Two more, as modded-nanogpt runs Muon: a group marked ``transposed`` (Hugging Face's ``Conv1D``
stores its weight ``(in, out)``; ``gradmod.optimizer`` marks them) is given to torch's step as the
``(out, in)`` view, so the adjustment reads the true shape; ``split=k`` orthogonalises each matrix's
``k`` row blocks (out features) apart, as ``k`` separate matrices: the Q, K and V of a fused ``c_attn``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


class Muon(torch.optim.Muon):
    """``torch.optim.Muon`` (same arguments, same defaults, same step) on parameters of 2 or
    more dimensions; a 1-D parameter is refused in one line, as torch refuses it. ``split``: the
    number of row blocks each matrix is orthogonalised in (1: whole)."""

    reads_transposed = True  # gradmod.optimizer marks the groups of (in, out) weights

    def __init__(self, params: Any, split: int = 1, **kwargs: Any) -> None:
        probe = torch.optim.Muon([torch.zeros(1, 1)], **kwargs)  # torch checks the arguments
        torch.optim.Optimizer.__init__(self, params, {**probe.defaults, "split": split})
        for group in self.param_groups:
            k = group["split"]
            if isinstance(k, bool) or not isinstance(k, int) or k < 1:
                raise ValueError(f"split={k!r} must be an int >= 1 (the row blocks orthogonalised apart)")
            for p in group["params"]:
                if p.ndim < 2:
                    raise ValueError(
                        f"Muon takes matrices and convolution kernels (2 or more dimensions), got a parameter "
                        f"of shape {tuple(p.shape)}; give biases, norms and other vectors to another optimizer"
                    )
                rows = p.shape[1] if group.get("transposed") else p.shape[0]
                if rows % k:
                    raise ValueError(
                        f"split={k} does not divide the {rows} out features of a matrix of shape {tuple(p.shape)}; "
                        "allowed: a divisor of every matrix's out features in the group (3 for a fused Q, K, V)"
                    )

    def _init_group(
        self, group: Any, params_with_grad: list[Tensor], grads: list[Tensor], muon_momentum_bufs: list[Tensor]
    ) -> bool:
        """torch's lists, a kernel's entries as matrices viewed in its memory order."""
        kernels = [p for p in group["params"] if p.grad is not None and p.ndim > 2]
        for p in kernels:  # torch makes a buffer like the gradient; a kernel's is like the kernel, so it views alike
            buf = self.state[p].get("momentum_buffer")
            if buf is None or buf.stride() != p.stride():
                self.state[p]["momentum_buffer"] = (
                    torch.zeros_like(p) if buf is None else torch.empty_like(p).copy_(buf)
                )
        has_complex = super()._init_group(group, params_with_grad, grads, muon_momentum_bufs)
        for i, p in enumerate(params_with_grad):
            if p.ndim > 2:
                order = _memory_order(p)
                params_with_grad[i] = _matrix(p, order)
                grads[i] = _matrix(grads[i], order, copy=True)
                muon_momentum_bufs[i] = _matrix(muon_momentum_bufs[i], order)
        if group.get("transposed"):  # (in, out) storage: torch's step sees the (out, in) matrix
            for lists in (params_with_grad, grads, muon_momentum_bufs):
                lists[:] = [t.T for t in lists]
        k = group.get("split", 1)
        if k > 1:  # each row block a matrix of its own: views, so the update lands in place
            for lists in (params_with_grad, grads, muon_momentum_bufs):
                lists[:] = [block for t in lists for block in t.chunk(k)]
        return has_complex


def _memory_order(p: Tensor) -> tuple[int, ...]:
    """The kernel's dimensions after the first, outermost in memory first (channels-last: h, w, in)."""
    return (0, *sorted(range(1, p.ndim), key=lambda d: -p.stride(d)))


def _matrix(t: Tensor, order: tuple[int, ...], copy: bool = False) -> Tensor:
    """``t`` as ``len(t) x rest`` in ``order``: a view of it, or with ``copy`` (a gradient, only read) a copy where no view exists."""
    moved = t.permute(order)
    if copy:
        return moved.reshape(len(t), -1)
    try:
        return moved.view(len(t), -1)
    except RuntimeError:
        raise ValueError(
            f"Muon updates a kernel through a matrix view of it; a tensor of shape {tuple(t.shape)} and strides "
            f"{t.stride()} has none (its first dimension is not outermost in memory)"
        ) from None
