"""Small exact solvers on the k x k Gramian of the task gradients (float64, on the host).

``bound_qps`` solves ``min_v v^T H v`` subject to ``v >= u`` for several bounds ``u`` at
once with a primal active-set method: each step solves one linear system per problem (all
of them in one batched call, the free coordinates' equations ``(H v)_j = 0`` and the bound
ones' ``v_j = u_j``), so the answer is exact up to rounding (the same problem a dense QP
solver answers; k is the number of tasks, small). UPGrad solves k such problems per step.
"""

from __future__ import annotations

import numpy as np


def bound_qps(H: np.ndarray, U: np.ndarray, max_steps: int | None = None) -> np.ndarray:
    """Row i: the minimiser of ``v^T H v`` over ``v >= U[i]`` (``H`` positive definite)."""
    U = np.atleast_2d(np.asarray(U, dtype=np.float64))
    m, k = U.shape
    V = U.copy()
    active = np.ones((m, k), dtype=bool)  # coordinates held at their bound
    todo = np.arange(m)  # the problems not solved yet
    tol = 1e-14 * (1.0 + np.abs(H).max()) * (1.0 + np.abs(U).max(1))
    eye = np.eye(k, dtype=bool)
    for _ in range(max_steps or 50 * k + 50):
        if not len(todo):
            return V
        act, v, u = active[todo], V[todo], U[todo]
        # One system per problem: H's row j where j is free, the identity's where j is bound.
        target = np.linalg.solve(np.where(act[:, :, None], eye, H), np.where(act, v, 0.0)[:, :, None])[:, :, 0]
        step = np.where(act, 0.0, target - v)  # bound coordinates stay exactly at their bounds
        moving = ~act.all(1) & (np.abs(step).max(1) > 1e-15 * (1.0 + np.abs(v).max(1)))
        # At a stationary point: done if every bound's multiplier is >= 0, else free the worst.
        lam = np.where(act, v @ H, np.inf)  # H symmetric: (H v)_j, half the multipliers
        j = lam.argmin(1)
        low = lam[np.arange(len(todo)), j]
        release = ~moving & (low < -tol[todo])
        active[todo[release], j[release]] = False
        # Moving: the longest step along ``step`` that keeps every free coordinate >= its bound.
        if moving.any():
            i, s, vv, ui = todo[moving], step[moving], v[moving], u[moving]
            blocking = ~act[moving] & (s < 0)
            ratio = np.full_like(s, np.inf)
            np.divide(ui - vv, s, out=ratio, where=blocking)
            b = ratio.argmin(1)
            first = ratio[np.arange(len(i)), b]
            V[i] = vv + np.minimum(1.0, first)[:, None] * s
            hit = first < 1.0
            active[i[hit], b[hit]] = True
            V[i[hit], b[hit]] = U[i[hit], b[hit]]
        todo = todo[moving | release]
    raise RuntimeError("bound_qps: the active-set method did not converge")


def bound_qp(H: np.ndarray, u: np.ndarray, max_steps: int | None = None) -> np.ndarray:
    """The minimiser of ``v^T H v`` over ``v >= u`` (``H`` positive definite)."""
    return bound_qps(H, np.asarray(u)[None], max_steps)[0]


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
