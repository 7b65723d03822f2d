"""Priority-constrained descent (PCD, torchjd's ``PCD``): the first loss is the primary one;
the update follows its gradient as closely as possible while every other loss keeps a share
``tau`` of the progress its own normalised gradient would make.

The gradients are normalised by the root of a bias-corrected moving average of their squared
norms (the state); the quadratic program ``min |d - g_1|^2 / 2`` subject to
``g_j^T d >= tau_j |g_j|^2`` is solved exactly on the Gramian by the dual active-set method
of Goldfarb and Idnani (1983) (``dual_active_set``), and the update rescaled to ``|g_1|``.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from gradmod.hooks.per_loss.methods.bases import GramianWeighting, _check, _per_task
from gradmod.hooks.per_loss.methods.rounding import precision


class PCD(GramianWeighting):
    """Priority-constrained descent (Varam et al. 2026, torchjd's ``PCD``): the primary (first)
    loss's gradient, bent only as far as every other loss's share ``tau`` of progress needs;
    ``tau`` one number or one per secondary loss, ``beta`` the moving average's decay."""

    name = "pcd"
    per_task_state = True

    def __init__(self, tau: float | list[float] = 0.02, beta: float = 0.999, eps: float = 1e-8):
        if isinstance(tau, (int, float)) and not isinstance(tau, bool):
            self.tau: float | list[float] = _check("pcd", "tau", tau, 0.0, high=1.0)
        else:
            self.tau = _per_task("pcd", "tau", tau, 0.0, high=1.0)
        self.beta = _check("pcd", "beta", beta, 0.0, high=math.nextafter(1.0, 0.0))
        self.eps = _check("pcd", "eps", eps, 0.0)
        self.ema: np.ndarray | None = None  # the moving average of the squared norms
        self.steps = 0

    def set_tasks(self, names: list[str]) -> None:
        if isinstance(self.tau, list) and len(self.tau) != len(names) - 1:
            raise ValueError(
                f"per_loss method 'pcd': tau has {len(self.tau)} values for {len(names) - 1} secondary losses; "
                "give one per loss after the first (the primary), or one number"
            )

    def weights(self, G, gen):
        tol = 10.0 * precision(G)  # the Gramian's relative rounding (torchjd's): below it, a direction is 0
        g = G.numpy()
        k = len(g)
        taus = np.asarray(self.tau if isinstance(self.tau, list) else [self.tau] * (k - 1), dtype=np.float64)
        sq = np.diagonal(g).copy()
        s = self._scales(sq)
        w = np.zeros(k)
        if sq[0] > 0.0:  # a primary loss without gradient: no update
            Gn = g * np.outer(s, s)
            mu = dual_active_set(Gn, taus, dependence_tol=max(1e-9, tol))
            d2 = mu @ Gn @ mu  # |d|^2 of the normalised direction, and the scale of its rounding
            if d2 > tol * (np.abs(mu) @ np.sqrt(np.diagonal(Gn))) ** 2:
                w = mu * s * math.sqrt(sq[0] / d2)
        return torch.from_numpy(w).to(G.dtype)

    def _scales(self, sq: np.ndarray) -> np.ndarray:
        """One more step of the moving average of the squared norms; each gradient's scale,
        ``1 / sqrt(debiased average + eps)`` (0 for a gradient that was always zero)."""
        if self.ema is None or len(self.ema) != len(sq):
            self.ema, self.steps = np.zeros(len(sq)), 0
        self.ema = self.beta * self.ema + (1.0 - self.beta) * sq
        self.steps += 1
        root = np.sqrt(self.ema / (1.0 - self.beta**self.steps) + self.eps)
        with np.errstate(divide="ignore"):
            return np.where(root > 0.0, 1.0 / root, 0.0)

    def state_dict(self):
        return {"ema": None if self.ema is None else torch.from_numpy(self.ema.copy()), "steps": self.steps}

    def load_state_dict(self, state):
        self.ema = None if state["ema"] is None else state["ema"].numpy().copy()
        self.steps = int(state["steps"])


def dual_active_set(G: np.ndarray, taus: np.ndarray, tol: float = 1e-9, dependence_tol: float = 1e-9) -> np.ndarray:
    """The weights ``[1, mu_2, ..., mu_k]`` of ``d = g_1 + sum_j mu_j g_j``, the minimiser of
    ``|d - g_1|^2 / 2`` subject to ``g_j^T d >= tau_j |g_j|^2``, the multipliers ``mu >= 0``;
    ``[1, 0, ..., 0]`` where the constraints cannot all hold.

    Goldfarb and Idnani's dual method: the violated constraint of least slack joins the active
    set, the step along ``z`` (its gradient off the active ones') either satisfying it (it is
    added) or first driving an active multiplier to 0 (that one leaves, and it is tried
    again). A constraint holds within ``tol`` times the largest squared norm; a gradient is
    dependent on the active ones where ``|z|^2`` is within ``dependence_tol`` of its own."""
    k = len(G)
    w = np.zeros(k)
    w[0] = 1.0
    if k == 1:
        return w
    S = G[1:, 1:]
    b = taus * np.diagonal(S) - G[1:, 0]  # b_j > 0: g_1 alone violates constraint j
    mu = np.zeros(k - 1)
    atol = tol * max(float(np.diagonal(G).max()), np.finfo(np.float64).tiny)
    active: list[int] = []
    budget = 10 * k  # steps: the method ends in about k; this only stops a cycle of rounding
    while budget > 0:
        slack = S @ mu - b
        slack[active] = 0.0
        p = int(np.argmin(slack))
        if slack[p] >= -atol:
            break
        budget, feasible = _add(S, b, mu, active, p, slack[p], budget, dependence_tol)
        if not feasible:
            return w
    w[1:] = np.maximum(mu, 0.0)
    return w


def _add(S, b, mu, active, p, slack_p, budget, dependence_tol):
    """Constraint ``p`` into the active set (``mu`` and ``active`` updated in place), dropping
    the active ones whose multiplier reaches 0 on the way; (budget left, whether feasible)."""
    while budget > 0:
        budget -= 1
        if active:
            r = np.linalg.solve(S[np.ix_(active, active)], S[active, p])
            z2 = S[p, p] - S[p, active] @ r
            with np.errstate(divide="ignore", invalid="ignore"):
                ratios = np.where(r > 0.0, mu[active] / r, np.inf)
            drop = int(np.argmin(ratios))
            partial = float(ratios[drop])
        else:
            r, z2, drop, partial = np.zeros(0), S[p, p], -1, math.inf
        full = -slack_p / z2 if z2 > dependence_tol * S[p, p] else math.inf
        step = min(partial, full)
        if step == math.inf:
            return budget, False  # p is dependent on the active ones, none of which can give way
        mu[active] -= step * r
        mu[p] += step
        if full <= partial:
            active.append(p)
            return budget, True
        mu[active[drop]] = 0.0
        del active[drop]
        slack_p = S[p] @ mu - b[p]
    return budget, True
