"""Small exact solvers on the k x k Gramian of the task gradients (float64, on the host).

``bound_qp`` solves ``min_v v^T H v`` subject to ``v >= u`` with a primal active-set method:
each step solves a linear system on the free coordinates, so the answer is exact up to
rounding (the same problem a dense QP solver answers; k is the number of tasks, small).
"""

from __future__ import annotations

import numpy as np


def bound_qp(H: np.ndarray, u: np.ndarray, max_steps: int | None = None) -> np.ndarray:
    """The minimiser of ``v^T H v`` over ``v >= u`` (``H`` positive definite)."""
    k = len(u)
    v = u.astype(np.float64).copy()
    active = np.ones(k, dtype=bool)  # coordinates held at their bound
    tol = 1e-14 * (1.0 + np.abs(H).max()) * (1.0 + np.abs(u).max())
    for _ in range(max_steps or 50 * k + 50):
        free = ~active
        target = v.copy()
        if free.any():
            target[free] = np.linalg.solve(H[np.ix_(free, free)], -H[np.ix_(free, active)] @ v[active])
        step = target - v
        if not free.any() or np.abs(step).max() <= 1e-15 * (1.0 + np.abs(v).max()):
            lam = H @ v  # half the multipliers of the bounds; >= 0 at the optimum
            lam[free] = np.inf
            j = int(np.argmin(lam))
            if lam[j] >= -tol:
                return v
            active[j] = False
            continue
        alpha, block = 1.0, -1
        for i in np.flatnonzero(free & (step < 0)):
            a = (u[i] - v[i]) / step[i]
            if a < alpha:
                alpha, block = a, i
        v = v + alpha * step
        if block >= 0:
            active[block] = True
            v[block] = u[block]
    raise RuntimeError("bound_qp: the active-set method did not converge")


def normalize(G: np.ndarray, eps: float) -> np.ndarray:
    """``G`` divided by its trace (the squared Frobenius norm of the Jacobian); zeros below ``eps``."""
    tr = np.trace(G)
    return np.zeros_like(G) if tr < eps else G / tr


def regularize(G: np.ndarray, eps: float) -> np.ndarray:
    return G + eps * np.eye(len(G))


def cagrad_socp(G: np.ndarray, c: float, norm_eps: float) -> np.ndarray:
    """CAGrad's weights: ``min_w w^T Gn 1/k + sqrt_phi |R^T w|`` over the simplex (``Gn = R R^T``
    the normalised Gramian), as a second-order cone program for Clarabel."""
    import clarabel
    from scipy import sparse

    k = len(G)
    Gn = normalize(G, norm_eps)
    # R R^T = Gn from the eigendecomposition (Gn is symmetric PSD, like its SVD)
    lam, V = np.linalg.eigh(Gn)
    R = V * np.sqrt(np.clip(lam, 0.0, None))
    g0 = R.T @ np.full(k, 1.0 / k)
    sqrt_phi = c * float(np.linalg.norm(g0))
    q = np.concatenate([R @ g0, [sqrt_phi]])  # x = (w, t): minimise q.x with |R^T w| <= t
    A = np.zeros((1 + k + 1 + k, k + 1))
    b = np.zeros(len(A))
    A[0, :k], b[0] = 1.0, 1.0  # sum w = 1
    A[1 : 1 + k, :k] = -np.eye(k)  # w >= 0
    A[1 + k, k] = -1.0  # (t, R^T w) in the second-order cone
    A[2 + k :, :k] = -R.T
    cones = [clarabel.ZeroConeT(1), clarabel.NonnegativeConeT(k), clarabel.SecondOrderConeT(k + 1)]
    settings = clarabel.DefaultSettings()
    settings.verbose = False
    sol = clarabel.DefaultSolver(sparse.csc_matrix((k + 1, k + 1)), q, sparse.csc_matrix(A), b, cones, settings).solve()
    w = np.asarray(sol.x[:k])
    gw = float(np.linalg.norm(R.T @ w))
    if gw < norm_eps:  # on the Pareto front: no direction improves every task
        return np.zeros(k)
    return np.full(k, 1.0 / k) + (sqrt_phi / gw) * w
