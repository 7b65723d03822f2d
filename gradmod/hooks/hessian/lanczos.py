"""The top eigenvalues of a symmetric operator by Lanczos with full reorthogonalisation.

Each step is one product; the tridiagonal matrix's eigenvalues (float64, on the host) are the
Ritz values, and the iteration stops once the ``k`` largest have residuals below ``tol`` times
their size (a warm start from the last estimate's eigenvectors gets there in a few steps), when
the Krylov space is exhausted (the operator's rank is reached), or after ``iterations`` steps.
Each new vector is projected off the whole basis twice, so no ghost copies of an eigenvalue appear;
it holds one vector per step. Inner products accumulate in float64 (``gradmod.hooks.hessian.dots``).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
from torch import Tensor

from gradmod.hooks.hessian.dots import dots, norm


class Ritz(NamedTuple):
    """The ``k`` largest Ritz values (largest first), their vectors (rows), the steps taken, and
    each value's residual over its size (at most ``tol`` once converged)."""

    values: list[float]
    vectors: Tensor
    steps: int
    residuals: list[float]


def lanczos(matvec: Callable[[Tensor], Tensor], start: Tensor, k: int, iterations: int, tol: float) -> Ritz:
    """The ``k`` largest eigenvalues of the symmetric ``matvec`` from the nonzero ``start``
    (``matvec``'s result is changed in place and not kept past the next call)."""
    n = start.numel()
    limit = min(iterations, n)
    # The basis in rows of one matrix, written in place and doubled when full: stacking a list at
    # each step would copy every vector again (ResNet-18: 11M parameters, gigabytes per estimate).
    basis = start.new_empty(min(limit, 8), n)
    torch.div(start, norm(start), out=basis[0])
    alphas: list[float] = []
    betas: list[float] = []
    values, vectors = torch.zeros(0, dtype=torch.float64), torch.zeros(0, 0, dtype=torch.float64)
    for step in range(1, limit + 1):
        stack = basis[:step]
        w = matvec(basis[step - 1])
        c = dots(stack, w)  # the projections; the last is alpha = v . H v
        alphas.append(float(c[-1]))
        w.addmv_(stack.T, c.to(w.dtype), alpha=-1)
        # twice is enough (Kahan-Parlett): one pass leaves w about eps |Hv| / beta off the basis,
        # far from orthogonal once beta is small; the second pass's last projection corrects
        # alpha (as ARPACK does)
        again = dots(stack, w)
        alphas[-1] += float(again[-1])
        w.addmv_(stack.T, again.to(w.dtype), alpha=-1)
        beta = norm(w)
        values, vectors = _ritz(alphas, betas)
        top = min(k, step)
        residual = beta * vectors[-1, -top:].abs()
        scale = values[-top:].abs().clamp_min(1e-30)
        exhausted = beta <= 1e-12 * max(1.0, float(values.abs().max()))
        if step == limit or exhausted or (step >= k and bool((residual <= tol * scale).all())):
            break
        betas.append(beta)
        if step == len(basis):
            basis = torch.cat([basis, basis.new_empty(min(limit, 2 * len(basis)) - len(basis), n)])
        torch.div(w, beta, out=basis[step])
    order = torch.arange(len(alphas) - 1, len(alphas) - 1 - top, -1)  # the last step's top, largest first
    ritz = (vectors[:, order].T.to(start.dtype).to(start.device)) @ basis[: len(alphas)]
    relative = (residual / scale).flip(0).tolist()  # the last step's test, in the same order
    return Ritz([float(values[i]) for i in order], ritz, len(alphas), relative)


def _ritz(alphas: list[float], betas: list[float]) -> tuple[Tensor, Tensor]:
    """Eigenvalues (ascending) and eigenvectors of the tridiagonal matrix, in float64."""
    t = torch.diag(torch.tensor(alphas, dtype=torch.float64))
    if betas:
        off = torch.tensor(betas, dtype=torch.float64)
        t = t + torch.diag(off, 1) + torch.diag(off, -1)
    return torch.linalg.eigh(t)
