"""The Gramian weightings: each method's weights from the k x k Gramian of the task gradients
(float64, on the host), the update ``sum_i w_i g_i`` (``methods.GramianWeighting``)."""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from gradmod.hooks.per_loss.methods import solvers
from gradmod.hooks.per_loss.methods.bases import GramianWeighting, _check, _count, _needs
from gradmod.hooks.per_loss.methods.rounding import spectrum
from gradmod.hooks.validators import MAX_STEP


class PCGrad(GramianWeighting):
    """Each task's gradient projected off the others it conflicts with, in random order; summed."""

    name = "pcgrad"

    def weights(self, G, gen):
        g, k = G.numpy(), len(G)
        total = np.zeros(k)
        for i in range(k):
            order = torch.randperm(k, generator=gen).tolist()
            c = np.zeros(k)
            c[i] = 1.0
            for j in order:
                if j == i:
                    continue
                dot = g[j] @ c  # <g_i^PC, g_j>
                if dot < 0.0:
                    c[j] -= dot / g[j, j]
            total = total + c
        return torch.from_numpy(total)


class MGDA(GramianWeighting):
    """The min-norm point of the convex hull of the task gradients (Frank-Wolfe)."""

    name = "mgda"

    def __init__(self, epsilon: float = 0.001, max_iters: int = 100):
        self.epsilon = _check("mgda", "epsilon", epsilon, 0.0, strict=True)
        self.max_iters = _count("mgda", "max_iters", max_iters)

    def weights(self, G, gen):
        g, k = G.numpy(), len(G)
        alpha = np.full(k, 1.0 / k)
        for _ in range(self.max_iters):
            t = int(np.argmin(g @ alpha))
            a, b, c = alpha @ g[:, t], alpha @ (g @ alpha), g[t, t]
            gamma = 1.0 if c <= a else 0.0 if b <= a else (b - a) / (b + c - 2 * a)
            alpha = (1 - gamma) * alpha
            alpha[t] += gamma
            if gamma < self.epsilon:
                break
        return torch.from_numpy(alpha)


class IMTLG(GramianWeighting):
    """Impartial MTL (gradient part): equal projections of the update on every task's direction,
    from the Gramian's pseudo-inverse, its rounding taken as 0 (``rounding.spectrum``)."""

    name = "imtl_g"

    def weights(self, G, gen):
        lam, V = spectrum(G)
        v = V @ ((V.T @ torch.sqrt(torch.diagonal(G).clamp(min=0.0))) / lam)
        s = v.sum()
        return torch.zeros_like(v) if s.abs() < 1e-12 else v / s


class AlignedMTL(GramianWeighting):
    """Aligned-MTL: the task gradients made orthogonal with equal norms (scaled by an eigenvalue),
    on the Gramian's eigenvalues that are not its rounding (``rounding.spectrum``)."""

    name = "aligned_mtl"
    SCALES = ("min", "median", "rmse")

    def __init__(self, scale_mode: str = "min"):
        if scale_mode not in self.SCALES:
            raise ValueError(
                f"per_loss method 'aligned_mtl': scale_mode={scale_mode!r}; allowed: {', '.join(self.SCALES)}"
            )
        self.scale_mode = scale_mode

    def weights(self, G, gen):
        k = len(G)
        lam, V = spectrum(G)
        if len(lam) == 0:
            return torch.full((k,), 1.0 / k, dtype=G.dtype)
        scale = {"min": lam[-1], "median": torch.median(lam), "rmse": lam.mean()}[self.scale_mode]
        B = scale.sqrt() * (V / lam.sqrt()) @ V.T
        return B @ torch.full((k,), 1.0 / k, dtype=G.dtype)


class _DualCone(GramianWeighting):
    """Projections onto the dual cone of the task gradients, as bound-constrained QPs on the
    normalised, regularised Gramian (``solvers.bound_qps``: exact)."""

    def __init__(self, norm_eps: float = 0.0001, reg_eps: float = 0.0001):
        self.norm_eps = _check(self.name, "norm_eps", norm_eps, 0.0)
        self.reg_eps = _check(self.name, "reg_eps", reg_eps, 0.0)

    def _H(self, G: Tensor) -> np.ndarray:
        return solvers.regularize(solvers.normalize(G.numpy(), self.norm_eps), self.reg_eps)


class UPGrad(_DualCone):
    """Each task gradient projected onto the dual cone of all of them; the mean of the projections."""

    name = "upgrad"

    def weights(self, G, gen):
        H, k = self._H(G), len(G)
        w = solvers.bound_qps(H, np.eye(k) / k).sum(0)
        return torch.from_numpy(np.asarray(w, dtype=np.float64)).to(G.dtype)


class DualProj(_DualCone):
    """The mean gradient projected onto the dual cone of the task gradients."""

    name = "dualproj"

    def weights(self, G, gen):
        H, k = self._H(G), len(G)
        return torch.from_numpy(solvers.bound_qp(H, np.full(k, 1.0 / k))).to(G.dtype)


class CAGrad(GramianWeighting):
    """Conflict-averse gradient: the update in a ball of radius ``c |g_0|`` around the mean that
    maximises the worst task's improvement (a cone program; Clarabel). ``rescale``: 0 leaves
    the update as it is (torchjd, the default); LibMTL's 1 divides it by ``1 + c^2``, 2 by ``1 + c``."""

    name = "cagrad"
    RESCALES = (0, 1, 2)

    def __init__(self, c: float = 0.5, norm_eps: float = 0.0001, rescale: int = 0):
        self.c = _check("cagrad", "c", c, 0.0, high=MAX_STEP)
        self.norm_eps = _check("cagrad", "norm_eps", norm_eps, 0.0)
        if rescale not in self.RESCALES or isinstance(rescale, bool):
            raise ValueError(f"per_loss method 'cagrad': rescale={rescale!r}; allowed: 0, 1, 2")
        self.rescale = {0: 1.0, 1: 1.0 + self.c**2, 2: 1.0 + self.c}[rescale]
        _needs("cagrad", ["clarabel", "scipy"], 'pip install clarabel scipy, or "torchjd[cagrad]"')

    def weights(self, G, gen):
        w = torch.from_numpy(solvers.cagrad_socp(G.numpy(), self.c, self.norm_eps)).to(G.dtype)
        return w / self.rescale


class GradVac(GramianWeighting):
    """Gradient Vaccine: each task's gradient pulled towards a running target cosine with the
    others (random order), from the Gramian; the EMA of the cosines is its state."""

    name = "gradvac"
    per_task_state = True

    def __init__(self, beta: float = 0.5, eps: float = 1e-8):
        self.beta = _check("gradvac", "beta", beta, 0.0, high=1.0)
        self.eps = _check("gradvac", "eps", eps, 0.0)
        self.phi: np.ndarray | None = None  # [k, k] target cosines (EMA)

    def weights(self, G, gen):
        k = len(G)
        if self.phi is None or self.phi.shape != (k, k):
            self.phi = np.zeros((k, k))
        g, phi, beta, eps = G.numpy(), self.phi, self.beta, self.eps
        C = np.eye(k)  # row i: g_i^PC in terms of the original gradients
        for i in range(k):
            cG = C[i] @ g
            others = [j for j in range(k) if j != i]
            for idx in torch.randperm(k - 1, generator=gen).tolist():
                j = others[idx]
                norm_i = math.sqrt(max((cG * C[i]).sum(), 0.0))
                norm_j = math.sqrt(max(g[j, j], 0.0))
                cos = cG[j] / (norm_i * norm_j + eps)
                target = phi[i, j]
                if cos < target:
                    s_cos = math.sqrt(max(1.0 - cos * cos, 0.0))
                    s_tgt = math.sqrt(max(1.0 - target * target, 0.0))
                    step = norm_i * (target * s_cos - cos * s_tgt) / (norm_j * s_tgt + eps)
                    C[i, j] = C[i, j] + step
                    cG = cG + step * g[j]
                phi[i, j] = (1.0 - beta) * target + beta * cos
        return torch.from_numpy(C.sum(0))

    def state_dict(self):
        return {"phi": None if self.phi is None else torch.from_numpy(self.phi.copy())}

    def load_state_dict(self, state):
        self.phi = None if state["phi"] is None else state["phi"].numpy().copy()
