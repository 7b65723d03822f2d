"""Small exact solvers on the k x k Gramian of the task gradients (float64, on the host).

``bound_qps`` solves ``min_v v^T H v`` subject to ``v >= u`` for several bounds ``u`` at
once by block principal pivoting (Judice and Pires' method for the linear complementarity
problem ``v - u >= 0, H v >= 0, (v - u) . H v = 0``): each step solves one linear system per
problem (all in one batched call: the free coordinates' equations ``(H v)_j = 0``, the bound
ones' ``v_j = u_j``) and swaps every coordinate on the wrong side at once, or the last one
alone where that stops making progress (Murty's rule, which always ends), so the answer is
exact up to rounding, in two to five steps where a one-swap active-set method takes about
twice the number of free coordinates. UPGrad solves k such problems per step.
"""

from __future__ import annotations

import numpy as np

SPARE = 3  # block swaps allowed without fewer wrong coordinates before Murty's rule


def bound_qps(H: np.ndarray, U: np.ndarray, max_steps: int | None = None) -> np.ndarray:
    """Row i: the minimiser of ``v^T H v`` over ``v >= U[i]`` (``H`` positive definite)."""
    U = np.atleast_2d(np.asarray(U, dtype=np.float64))
    m, k = U.shape
    V = U.copy()
    bound = np.ones((m, k), dtype=bool)  # coordinates held at their bound: all, at first
    fewest = np.full(m, k + 1)  # the fewest wrong coordinates a step has had
    spare = np.full(m, SPARE)
    todo = np.arange(m)  # the problems not solved yet
    tol = 1e-14 * (1.0 + np.abs(H).max()) * (1.0 + np.abs(U).max(1))
    eye = np.eye(k, dtype=bool)
    for _ in range(max_steps or 50 * k + 50):
        if not len(todo):
            return V
        b, u, t = bound[todo], U[todo], tol[todo, None]
        v = np.where(b, u, _solve(H, eye, b, u))
        # Wrong: a free coordinate below its bound, a bound one whose multiplier (H v)_j < 0.
        wrong = np.where(b, v @ H < -t, v < u - t)
        V[todo] = np.maximum(v, u)
        n = wrong.sum(1)
        better = n < fewest[todo]
        fewest[todo[better]] = n[better]
        spare[todo[better]] = SPARE
        block = better | (spare[todo] > 0)
        spare[todo[block & ~better]] -= 1
        last = k - 1 - wrong[:, ::-1].argmax(1)
        swap = np.where(block[:, None], wrong, np.arange(k) == last[:, None])
        left = n > 0
        bound[todo[left]] ^= swap[left]
        todo = todo[left]
    raise RuntimeError("bound_qps: block principal pivoting did not converge")


def _solve(H: np.ndarray, eye: np.ndarray, bound: np.ndarray, u: np.ndarray) -> np.ndarray:
    """One system per problem: H's row j where j is free (``(H v)_j = 0``), the identity's
    where j is bound (``v_j = u_j``)."""
    return np.linalg.solve(np.where(bound[:, :, None], eye, H), np.where(bound, u, 0.0)[:, :, None])[:, :, 0]


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
