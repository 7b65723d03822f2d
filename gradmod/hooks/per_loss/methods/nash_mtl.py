"""Nash-MTL: weights from the bargaining solution over the task Gramian, by a sequence of
convex programs, each handed to ECOS (an optional dependency) as an exponential-cone program."""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from gradmod.hooks.per_loss.methods.bases import GramianWeighting, _check, _count, _needs

SOLVED = {0, 10, -1}  # ECOS's exit flags with a solution: optimal, inaccurate, at the iteration limit


class NashMTL(GramianWeighting):
    """Nash-MTL: the bargaining solution ``G w = 1 / w`` by a sequence of convex programs
    (ECOS); the update's norm capped at ``max_norm`` (0: no cap). ``heads``: the
    parameters outside the rule get the gradient of the plain sum (``sum``, torchjd) or of
    ``sum_i alpha_i L_i`` with the uncapped weights (``weighted``, LibMTL and the authors)."""

    name = "nash_mtl"
    per_task_state = True
    HEADS = ("sum", "weighted")

    def __init__(self, max_norm: float = 1.0, update_weights_every: int = 1, optim_niter: int = 20, heads: str = "sum"):
        if heads not in self.HEADS:
            raise ValueError(f"per_loss method 'nash_mtl': heads={heads!r}; allowed: {', '.join(self.HEADS)}")
        self.heads = heads
        self.max_norm = _check("nash_mtl", "max_norm", max_norm, 0.0)
        self.every = _count("nash_mtl", "update_weights_every", update_weights_every, 1, math.inf)
        self.niter = _count("nash_mtl", "optim_niter", optim_niter)
        _needs("nash_mtl", ["ecos"], 'pip install ecos, or "torchjd[nash_mtl]"')
        self.step = 0
        self.alpha: np.ndarray | None = None  # the last weights (float32, as the reference keeps them)

    def _solve(self, gtg: np.ndarray, norm: float) -> np.ndarray:
        """The authors' sequence: from the last weights, minimise ``sum(G a) + slope . a``
        (``slope`` linearised at the last weights) subject to ``log a_i + log (G a)_i >=
        -log norm``, until the weights solve ``G a = 1 / a`` or stop moving."""
        alpha = self.alpha
        program = _program(gtg, float(np.log(norm)))  # the same constraints at every convex step
        cost = gtg.sum(0)  # sum(G a)'s coefficients
        for _ in range(self.niter):
            prev = np.asarray(alpha, dtype=np.float64)
            with np.errstate(divide="ignore", invalid="ignore"):  # a task without gradient: _step refuses the cost
                slope = (1 / prev + (1 / (gtg @ prev)) @ gtg) / norm
            a = _step(program, cost + slope)
            if (
                a is None  # no solution (infeasible, a failure): the last weights stay
                or np.linalg.norm(gtg @ alpha - 1 / (alpha + 1e-10)) < 1e-3
                or np.linalg.norm(a - prev) < 1e-6
            ):
                break
            alpha = a
        if alpha is not None:
            self.alpha = alpha
        return self.alpha

    def weights(self, G, gen):
        k = len(G)
        if self.alpha is None:
            self.alpha = np.ones(k, dtype=np.float32)
        if self.step % self.every == 0:
            norm = float(torch.linalg.norm(G))
            alpha = self._solve((G / norm).numpy(), norm)
        else:
            alpha = self.alpha
        self.step += 1
        w = torch.from_numpy(np.asarray(alpha)).to(G.dtype)
        if self.max_norm > 0:
            n = (w @ G @ w).clamp(min=0.0).sqrt()  # |J^T w| from the Gramian
            if n > self.max_norm:
                w = w / n * self.max_norm
        return w

    @property
    def weighs_rest(self) -> bool:
        return self.heads == "weighted"

    def rest_weights(self) -> Tensor | None:
        """``heads: weighted``: the weights of the losses for the parameters outside the rule."""
        return None if self.heads == "sum" or self.alpha is None else torch.from_numpy(np.array(self.alpha))

    def state_dict(self):  # tensors, not numpy arrays: checkpoints load with weights_only=True
        return {"step": self.step, "alpha": None if self.alpha is None else torch.from_numpy(np.array(self.alpha))}

    def load_state_dict(self, state):
        self.step = int(state["step"])
        alpha = state["alpha"]
        self.alpha = None if alpha is None else np.array(alpha.numpy() if isinstance(alpha, Tensor) else alpha)


def _program(G: np.ndarray, log_norm: float) -> tuple:
    """ECOS's constraints ``h - Gm x`` in its cones for ``log a_i + log (G a)_i >= -log_norm``
    (and ``a >= 0``) over ``x = (a, t, s)``: ``t_i <= log a_i`` and ``s_i <= log (G a)_i`` as
    exponential cones ``(t_i, a_i, 1)`` and ``(s_i, (G a)_i, 1)``, ``t_i + s_i >= -log_norm``
    linear. First the linear rows (``-a <= 0``, ``-t - s <= log_norm``), then per cone three
    rows in ECOS's order (x, y, z) with ``exp(x / z) <= y / z``."""
    from scipy import sparse

    k = len(G)
    eye, zero = np.eye(k), np.zeros((k, k))
    lin = np.block([[-eye, zero, zero], [zero, -eye, -eye]])
    cones = np.zeros((2 * k, 3, 3 * k))
    cones[:k, 0, k : 2 * k] = -eye  # t_i
    cones[:k, 1, :k] = -eye  # a_i
    cones[k:, 0, 2 * k :] = -eye  # s_i
    cones[k:, 1, :k] = -G  # (G a)_i
    h = np.concatenate([np.zeros(k), np.full(k, log_norm), np.tile([0.0, 0.0, 1.0], 2 * k)])
    return sparse.csc_matrix(np.vstack([lin, cones.reshape(6 * k, 3 * k)])), h, {"l": 2 * k, "q": [], "e": 2 * k}


def _step(program: tuple, c: np.ndarray) -> np.ndarray | None:
    """``argmin c . a`` subject to ``program`` (``_program``), by ECOS. None where it finds no
    solution (the program has none, or the solver fails)."""
    import ecos

    if not np.isfinite(c).all():  # a task with no gradient, or one exactly against another
        return None
    Gm, h, dims = program
    k = len(c)
    try:
        sol = ecos.solve(np.concatenate([c, np.zeros(2 * k)]), Gm, h, dims, verbose=False, max_iters=100)
    except ValueError:  # data ECOS refuses
        return None
    return np.asarray(sol["x"][:k]) if sol["info"]["exitFlag"] in SOLVED else None
