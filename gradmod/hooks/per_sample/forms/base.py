"""``Form``: what a layer type answers about its per-example gradients (the base of every
form in ``layers`` and ``recurrent``, and of a user's own given to ``register_form``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn


def broadcast_weights(w: Tensor, like: Tensor) -> Tensor:
    """Per-example weights ``[B]`` shaped to multiply ``like`` (batch first)."""
    return w.view(-1, *[1] * (like.dim() - 1)).to(like.dtype)


def as_rows(g: Tensor) -> Tensor:
    """``[B, *param]`` as ``[B, numel]`` (a 0-dim parameter too)."""
    return g.reshape(g.shape[0], -1)


def rows_norm2(g: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """Each example's squared norm of ``g`` (``[B, *param]``) in ``dtype``: one reduction, no
    squared copy (a large temporary costs more to map than to fill)."""
    return torch.linalg.vector_norm(as_rows(g), dim=1, dtype=dtype).square()


class Form:
    """Defaults from ``per_example``: right for every layer, fast for small parameters.
    Subclass it and implement ``per_example(m, a, b, names)``: ``a`` the layer's input,
    ``b`` its output gradient (batch first), ``names`` the local names of the parameters
    asked for; return ``{name: [B, *param.shape]}``, example i's gradient of each."""

    whole_call = False  # True: ``a`` is the call's Inputs, ``b`` the list of output gradients
    takes_packed = False  # True (whole_call too): PackedSequence inputs and outputs (dim ``PACKED``)
    fresh = False  # True: ``per_example``'s tensors are new, never views of inputs (the stage adds to them in place)
    captures = False  # True: records calls inside its module's forward (``attention``), children's params too
    detaches = False  # True: its weights may run detached after the first backward (``detached_weights``)
    second_order = False  # True: ``y`` is bilinear in ``weight`` and the input (``second_order``)

    def applies(self, m: nn.Module) -> bool:
        """Whether this form answers for ``m`` (False: ``m`` takes the general path)."""
        return True

    def refusal(self, m: nn.Module) -> str | None:
        """Why this form cannot give ``m``'s per-example gradients (None: it can)."""
        return None

    def per_example(self, m: nn.Module, a: Any, b: Any, names: set[str]) -> dict[str, Tensor]:
        raise NotImplementedError

    def add_per_example(self, m: nn.Module, a: Any, b: Any, names: set[str], into: dict[str, Tensor]):
        """``per_example``, added in place to ``into``'s tensors (the stage's own) where it has one."""
        return {n: into[n].add_(g) if n in into else g for n, g in self.per_example(m, a, b, names).items()}

    def materialises(self, m: nn.Module, a: Any, b: Tensor) -> bool:
        """Whether ``per_example`` (then norms and the weighted sum from it) is the cheaper way."""
        return True

    def norms2(self, m, a, b, names) -> dict[str, Tensor]:
        return {n: rows_norm2(g) for n, g in self.per_example(m, a, b, names).items()}

    def weighted(self, m, a, b, w: Tensor, names) -> dict[str, Tensor]:
        return {n: torch.tensordot(w.to(g.dtype), g, 1) for n, g in self.per_example(m, a, b, names).items()}


class Inputs:
    """One call's inputs as the module got them, with each tensor's batch dimension
    (``dims``: the same tree as ``(args, kwargs)``, None where a leaf is shared)."""

    def __init__(self, args: tuple, kwargs: dict, dims: Any):
        self.args, self.kwargs, self.dims = args, kwargs, dims


class PerExample:
    """One backward's per-example tensors, summed per parameter over the calls that use it
    (tied weights: an embedding and its output layer), in place where a tensor is the stage's own."""

    def __init__(self) -> None:
        self.sums: dict[Tensor, Tensor] = {}
        self._own: set[Tensor] = set()

    def add(self, form: Form, m: nn.Module, a: Any, b: Any, params: dict[str, Tensor], formed=None) -> None:
        """``formed``: the call's per-example tensors, formed in the backward already (else here)."""
        into = {n: self.sums[p] for n, p in params.items() if p in self._own}
        if formed is None:
            formed = form.add_per_example(m, a, b, set(params), into)
        else:
            formed = {n: into[n].add_(g) if n in into else g for n, g in formed.items()}
        for n, g in formed.items():
            p = params[n]
            merge = p in self.sums and n not in into
            self.sums[p] = self.sums[p] + g if merge else g
            if merge or form.fresh:
                self._own.add(p)
