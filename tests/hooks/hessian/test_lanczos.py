"""Lanczos (``gradmod.hooks.hessian.lanczos``) against ``torch.linalg.eigvalsh`` on symmetric
matrices of known spectrum, in float64 and float32, from random and nearly converged starts."""

from __future__ import annotations

import pytest
import torch

from gradmod.hooks.hessian.dots import dots, norm
from gradmod.hooks.hessian.lanczos import lanczos


def _matrix(n: int, top: list[float], dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A symmetric n x n matrix with the given top eigenvalues over a bulk in [-0.1, 0.5], and its
    eigenvectors (columns, ascending)."""
    gen = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
    bulk = torch.rand(n - len(top), generator=gen, dtype=torch.float64) * 0.6 - 0.1
    values = torch.cat([bulk, torch.tensor(top, dtype=torch.float64)]).sort().values
    return ((q * values) @ q.T).to(dtype), q[:, values.argsort()].to(dtype)


@pytest.mark.parametrize("dtype, rel", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_the_top_eigenvalues_equal_eigvalsh(dtype, rel):
    a, _ = _matrix(400, [3.0, 2.9, 2.0], dtype)
    start = torch.randn(400, generator=torch.Generator().manual_seed(1), dtype=dtype)
    ritz = lanczos(lambda v: a @ v, start, k=3, iterations=120, tol=1e-9 if dtype == torch.float64 else 1e-6)
    exact = torch.linalg.eigvalsh(a.double()).flip(0)[:3]
    assert torch.allclose(torch.tensor(ritz.values, dtype=torch.float64), exact, rtol=rel, atol=0)
    gram = ritz.vectors.double() @ ritz.vectors.double().T  # the Ritz vectors orthonormal: no ghost copy
    assert torch.allclose(gram, torch.eye(3, dtype=torch.float64), atol=100 * torch.finfo(dtype).eps ** 0.5)
    for value, vector, residual in zip(ritz.values, ritz.vectors.double(), ritz.residuals):  # as reported
        true = float((a.double() @ vector - value * vector).norm()) / value
        assert true == pytest.approx(residual, rel=0.1, abs=1e-7)


def test_many_steps_in_float32_give_no_ghost_copy_of_the_top_eigenvalue():
    """Past convergence plain Lanczos repeats a converged eigenvalue (a ghost); the projection
    off the whole basis keeps the second Ritz value at the second eigenvalue."""
    a, _ = _matrix(300, [5.0, 0.55], torch.float32)
    start = torch.randn(300, generator=torch.Generator().manual_seed(2))
    ritz = lanczos(lambda v: a @ v, start, k=2, iterations=80, tol=1e-7)
    assert ritz.steps >= 30  # the top value converged long before the second
    exact = torch.linalg.eigvalsh(a.double()).flip(0)[:2]
    assert ritz.values == pytest.approx(exact.tolist(), rel=1e-5)


def test_a_start_almost_an_eigenvector_keeps_the_basis_orthonormal():
    """From a start 1e-6 off the top eigenvector the first product's remainder is a millionth of it:
    one projection pass leaves it 1e-3 off orthogonal in float32; the basis must stay orthonormal."""
    a, vectors = _matrix(300, [4.0, 3.5], torch.float32)
    start = vectors[:, -1] + 1e-6 * torch.randn(300, generator=torch.Generator().manual_seed(3))
    ritz = lanczos(lambda v: a @ v, start, k=3, iterations=3, tol=1e-12)
    gram = ritz.vectors.double() @ ritz.vectors.double().T
    assert ritz.values[0] == pytest.approx(4.0, rel=1e-6)
    assert float((gram - torch.eye(3, dtype=torch.float64)).abs().max()) < 1e-6


def test_long_float32_vectors_give_the_rayleigh_quotient_of_the_ritz_vector():
    """Over 3M float32 entries BLAS sums in float32 lanes (with them the Ritz value came out 2.5e-5
    below its vector's Rayleigh quotient here); it must be the quotient (in float64) to 1e-6."""
    n = 3_000_000
    gen = torch.Generator().manual_seed(4)
    diag = torch.rand(n, generator=gen) + 0.5
    diag[:3] = torch.tensor([3.0, 2.0, 1.8])
    start = torch.ones(n) + 0.01 * torch.randn(n, generator=gen)
    ritz = lanczos(lambda v: v * diag, start, k=1, iterations=6, tol=1e-12)
    u = ritz.vectors[0].double()
    rayleigh = float(u @ (u * diag.double()) / (u @ u))
    assert ritz.values[0] == pytest.approx(rayleigh, rel=1e-6)


def test_inner_products_of_long_float32_vectors_are_float64_accurate():
    n = 12_000_000  # ResNet-18's size, where torch.mv in float32 sums lanes off by up to 2e-3
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(n, generator=gen).abs_().add_(0.1)
    rows = torch.stack([w / 3, torch.ones(n)])
    exact = rows.double() @ w.double()
    assert torch.allclose(dots(rows, w), exact, rtol=1e-6, atol=0)
    assert norm(w) == pytest.approx(float(w.double().norm()), rel=1e-6)
