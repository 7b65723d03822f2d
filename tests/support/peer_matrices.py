"""The matrices torchjd 0.18's aggregation tests run each aggregator on, built the same way
(float64 here): random matrices of given shape and rank, zero ones, ones whose rows some
positive combination cancels (strongly stationary), some non-negative one only (strictly
weakly), none (non-weakly), and the first kind scaled from 0 to 1e15.

The shapes, ranks, kinds and scales are torchjd's; the sampling is written here (a uniformly
random orthonormal basis from the QR of a normal matrix, the singular values |N(0, 1)|).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

NORMAL = [(1, 1, 1), (4, 3, 1), (4, 3, 2), (4, 3, 3), (9, 11, 5), (9, 11, 9)]
ZERO = [(1, 1), (4, 3), (9, 11)]
STATIONARY = [(20, 10, 10), (20, 10, 5), (20, 10, 1), (20, 100, 1), (20, 100, 19)]
SCALES = [0.0, 1e-10, 1e3, 1e5, 1e10, 1e15]


def _complement(Q: Tensor, g: torch.Generator) -> Tensor:
    """A random orthonormal basis of the orthogonal complement of ``Q``'s columns."""
    m, k = Q.shape
    A = torch.randn(m, m - k, generator=g, dtype=torch.float64)
    return torch.linalg.qr(A - Q @ (Q.T @ A))[0]


def _orthonormal(n: int, g: torch.Generator) -> Tensor:
    return _complement(torch.zeros(n, 0, dtype=torch.float64), g)


def _with_left(U: Tensor, n: int, rank: int, g: torch.Generator) -> Tensor:
    """``U[:, :rank] S V^T``: a matrix of that rank whose left singular vectors are ``U``'s."""
    S = torch.diag(torch.randn(rank, generator=g, dtype=torch.float64).abs())
    return U[:, :rank] @ S @ _orthonormal(n, g)[:rank]


def _unit(v: Tensor) -> Tensor:
    return v / v.norm()


def normal(m: int, n: int, rank: int, g: torch.Generator) -> Tensor:
    return _with_left(_orthonormal(m, g), n, rank, g)


def strong(m: int, n: int, rank: int, g: torch.Generator) -> Tensor:
    """Rows orthogonal to a positive ``v``: ``v^T A = 0``."""
    v = _unit(torch.randn(m, generator=g, dtype=torch.float64).abs())[:, None]
    return _with_left(_complement(v, g), n, rank, g)


def strictly_weak(m: int, n: int, rank: int, g: torch.Generator) -> Tensor:
    """Rows orthogonal to a non-negative ``v`` with zeros, while a non-negative ``v'`` on the
    other coordinates is a left singular vector: no positive combination of rows cancels."""
    u = torch.randn(m, generator=g, dtype=torch.float64).abs()
    split = int(torch.randint(1, m, (), generator=g))
    order = torch.randperm(m, generator=g)
    v, v2 = torch.zeros(m, dtype=torch.float64), torch.zeros(m, dtype=torch.float64)
    v[order[:split]] = _unit(u[order[:split]])
    v2[order[split:]] = _unit(u[order[split:]])
    pair = torch.stack([v, v2], 1)
    U = torch.cat([pair, _complement(pair, g)], 1)
    return _with_left(U[:, 1:], n, rank, g)


def non_weak(m: int, n: int, rank: int, g: torch.Generator) -> Tensor:
    """A positive left singular vector: no non-negative combination of rows cancels."""
    u = _unit(torch.randn(m, generator=g, dtype=torch.float64).abs())[:, None]
    return _with_left(torch.cat([u, _complement(u, g)], 1), n, rank, g)


@functools.cache
def fixtures(seed: int = 0) -> dict[str, list[Tensor]]:
    """``typical`` (zero, normal and the three stationarity kinds) and ``scaled`` matrices
    (built once per process; read, never written)."""
    g = torch.Generator().manual_seed(seed)
    matrices = [normal(m, n, r, g) for m, n, r in NORMAL]
    zeros = [torch.zeros(m, n, dtype=torch.float64) for m, n in ZERO]
    kinds = [[make(m, n, r, g) for m, n, r in STATIONARY] for make in (strong, strictly_weak, non_weak)]
    typical = zeros + matrices + [a for kind in kinds for a in kind]
    scaled = [s * a for s in SCALES for a in matrices]
    return {"typical": typical, "scaled": scaled}


def named(min_rows: int = 2, seed: int = 0) -> list[tuple[str, Tensor]]:
    """Every fixture with at least ``min_rows`` rows, each with a name for messages."""
    out = []
    for kind, mats in fixtures(seed).items():
        out += [(f"{kind}[{i}] {tuple(a.shape)}", a) for i, a in enumerate(mats) if a.shape[0] >= min_rows]
    return out
