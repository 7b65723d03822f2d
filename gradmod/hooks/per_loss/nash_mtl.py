"""Nash-MTL: weights from the bargaining solution over the task Gramian, solved with cvxpy
(an optional dependency) warm-started from the previous step."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from gradmod.hooks.per_loss.methods import Method, _check, _needs


class NashMTL(Method):
    """Nash-MTL: the bargaining solution ``G w = 1 / w`` by a sequence of convex programs
    (cvxpy, ECOS); the update's norm capped at ``max_norm`` (0: no cap). ``heads``: the
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
        self.every = int(_check("nash_mtl", "update_weights_every", update_weights_every, 1))
        self.niter = int(_check("nash_mtl", "optim_niter", optim_niter, 1))
        _needs("nash_mtl", ["cvxpy", "ecos"], 'pip install cvxpy ecos, or "torchjd[nash_mtl]"')
        self.step = 0
        self.alpha: np.ndarray | None = None  # the last weights (float32, as the reference keeps them)
        self._problem = None

    def _build(self, k: int) -> None:
        """The convex step in parameters only cvxpy can cache (DPP): the linearisation's
        coefficients ``(1 / prev + (1 / (G prev)) G) / norm`` computed on the host each solve."""
        import cvxpy as cp

        a = cp.Variable(k, nonneg=True)
        G = cp.Parameter((k, k), value=np.eye(k))
        slope = cp.Parameter(k, value=np.ones(k))
        log_norm = cp.Parameter(value=0.0)
        Ga = G @ a
        cons = [-cp.log(a[i]) - cp.log(Ga[i]) <= log_norm for i in range(k)]  # log(a_i norm) + log(G a)_i >= 0
        self._problem = (cp.Problem(cp.Minimize(cp.sum(Ga) + slope @ a), cons), a, G, slope, log_norm)

    def _solve(self, gtg: np.ndarray, norm: np.ndarray) -> np.ndarray:
        import cvxpy as cp

        prob, a, G, slope, log_norm = self._problem
        G.value, log_norm.value = gtg, float(np.log(norm[0]))
        alpha = self.alpha
        for _ in range(self.niter):
            prev = np.asarray(alpha, dtype=np.float64)
            slope.value = (1 / prev + (1 / (gtg @ prev)) @ gtg) / norm[0]
            a.value = prev
            try:
                prob.solve(solver=cp.ECOS, warm_start=True, max_iters=100)
            except (cp.SolverError, ValueError):
                a.value = prev
            if (
                a.value is None
                or np.linalg.norm(gtg @ alpha - 1 / (alpha + 1e-10)) < 1e-3
                or np.linalg.norm(a.value - prev) < 1e-6
            ):
                break
            alpha = a.value
        if alpha is not None:
            self.alpha = alpha
        return self.alpha

    def weights(self, G, gen):
        k = len(G)
        if self.alpha is None:
            self.alpha = np.ones(k, dtype=np.float32)
        if self._problem is None:
            self._build(k)
        if self.step % self.every == 0:
            norm = np.array([float(torch.linalg.norm(G))])
            alpha = self._solve((G / norm[0]).numpy(), norm)
        else:
            alpha = self.alpha
        self.step += 1
        w = torch.from_numpy(np.asarray(alpha)).to(G.dtype)
        if self.max_norm > 0:
            n = (w @ G @ w).clamp(min=0.0).sqrt()  # |J^T w| from the Gramian
            if n > self.max_norm:
                w = w / n * self.max_norm
        return w

    def rest_weights(self) -> Tensor | None:
        """``heads: weighted``: the weights of the losses for the parameters outside the rule."""
        return None if self.heads == "sum" or self.alpha is None else torch.from_numpy(np.array(self.alpha))

    def state_dict(self):  # tensors, not numpy arrays: checkpoints load with weights_only=True
        return {"step": self.step, "alpha": None if self.alpha is None else torch.from_numpy(np.array(self.alpha))}

    def load_state_dict(self, state):
        self.step = int(state["step"])
        alpha = state["alpha"]
        self.alpha = None if alpha is None else np.array(alpha.numpy() if isinstance(alpha, Tensor) else alpha)
        self._problem = None
