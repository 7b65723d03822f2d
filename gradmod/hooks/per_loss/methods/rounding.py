"""The rounding a Gramian carries, for the methods that decide its rank (IMTL-G, Aligned-MTL,
ConFIG, PCD).

The stage forms the Gramian in float64 (``entries.gram``) but the task gradients come in
their model's dtype, so a float32 model's carries float32's rounding: two dependent task
gradients leave an eigenvalue near ``1e-7`` of the largest there, not 0, and a tolerance of
float64's inverts it. ``precision`` is that rounding (the stage names the dtype around each
method's call: ``formed_in``), ``rank_rtol`` the eigenvalues it accounts for, torchjd's
tolerance for a Gramian of that dtype. ``spectrum`` decides on the unit Gramian (the task
gradients scaled to norm 1), whose rounding is the same for every task: a task whose
gradient is a thousandth of another's is not mistaken for rounding.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

import torch
from torch import Tensor

GRAM_RTOL = 1e-13  # a float64 Gramian's own rounding (its sums, its entries' sum): no rank below it

_FORMED_IN: ContextVar[torch.dtype | None] = ContextVar("gramian_formed_in", default=None)


@contextlib.contextmanager
def formed_in(dtype: torch.dtype) -> Iterator[None]:
    """Within it, ``precision`` is ``dtype``'s: the Gramians weighed come from task gradients
    of that dtype (or computed under autocast to it)."""
    token = _FORMED_IN.set(dtype)
    try:
        yield
    finally:
        _FORMED_IN.reset(token)


def precision(G: Tensor) -> float:
    """The relative rounding of the Gramian ``G``: the machine epsilon of its task gradients'
    dtype (``formed_in``), not of ``G``'s own; outside the stage, of ``G``'s dtype."""
    dtype = _FORMED_IN.get()
    return float(torch.finfo(G.dtype if dtype is None else dtype).eps)


def rank_rtol(G: Tensor) -> float:
    """Eigenvalues of a unit Gramian below this share of the largest are its rounding, 0 in
    exact arithmetic: ``k`` times ``precision``, torchjd's tolerance for a Gramian of that
    dtype (``AlignedMTL``'s threshold, ``IMTLG``'s pseudo-inverse), and no less than
    ``GRAM_RTOL`` (a float64 one's sums leave a few times float64's epsilon)."""
    return max(len(G) * precision(G), GRAM_RTOL)


def unit(G: Tensor) -> tuple[Tensor, Tensor]:
    """``(N G N, 1 / N)``: the Gramian of the task gradients scaled to norm 1 (``N`` the inverse
    norms, 0 for a task without gradient), and the norms."""
    norms = torch.diagonal(G).clamp(min=0.0).sqrt()
    inv = torch.where(norms > 0, 1.0 / norms, torch.zeros_like(norms))
    return G * torch.outer(inv, inv), norms


def spectrum(G: Tensor) -> tuple[Tensor, Tensor]:
    """The eigenvalues of ``G`` that are not its rounding, largest first, and their
    eigenvectors: as many as the unit Gramian's above ``rank_rtol`` of its largest, of ``G``
    rebuilt from those (the directions of its rounding taken out); every one where none is."""
    Gu, norms = unit(G)
    lam, U = torch.linalg.eigh(Gu)
    keep = lam > rank_rtol(G) * lam.max()
    rank = int(keep.sum())
    if rank < len(G):
        M = U[:, keep] * norms[:, None]
        G = (M * lam[keep]) @ M.T
    lam, V = torch.linalg.eigh(G)
    return lam.flip(0)[:rank], V.flip(1)[:, :rank]
