"""The per_loss methods: from k task gradients (or k losses) to one update.

Three kinds, by what a method needs:

* ``gramian``: weights ``w`` (k) from the task gradients' Gramian ``G = J J^T``; the
  update is ``J^T w``. The stage never forms ``J`` for these (see ``stage``).
* ``jacobian``: the update from the task gradients themselves (``graddrop``).
* ``losses``: loss weightings that need the loss values only; the update is the gradient
  of ``sum_i w_i L_i``.

Weights are computed on the host in float64 (k is small; the Gramian comes over in one
copy). Random choices draw from the stage's generator, passed in as ``gen``.
``gradmod.register(name, factory, kind="per_loss")`` adds a method of one's own: ``factory(**args)`` returns an
object with ``kind`` and ``weights`` (or ``aggregate``), like the classes here.
"""

from __future__ import annotations

import importlib.util
import math
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor

from gradmod.hooks import registry as R
from gradmod.hooks.per_loss import solvers

KINDS = ("gramian", "jacobian", "losses")


def register(name: str, factory: Callable[..., Method] | None = None, *, overwrite: bool = False):
    """Deprecated: ``gradmod.register(name, factory, kind="per_loss")``."""
    R.warn_moved("gradmod.hooks.per_loss.register")
    return R.register(name, factory, kind="per_loss", overwrite=overwrite)


def names() -> list[str]:
    return R.names("per_loss")


def is_method(name: str) -> bool:
    return name in R.names("per_loss")


def build(name: str, args: Mapping[str, Any]) -> Method:
    """The configured method; bad arguments are a ValueError naming the allowed ones."""
    return R.build({"name": name, **args}).fn


def _check(name: str, arg: str, value: Any, low: float, *, strict: bool = False, high: float = math.inf) -> float:
    ok = (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and (value > low if strict else value >= low)
        and value <= high
    )
    if not ok:
        bound = f"> {low}" if strict else f">= {low}"
        raise ValueError(
            f"per_loss method {name!r}: {arg}={value!r} must be a number {bound}"
            + (f" and <= {high}" if high < math.inf else "")
        )
    return float(value)


def _needs(name: str, modules: list[str], extra: str) -> None:
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise ValueError(f"per_loss method {name!r} needs {', '.join(missing)}, not installed ({extra})")


class Method:
    """Base: stateless unless ``state_dict`` says otherwise."""

    kind = "gramian"
    name = "method"

    def weights(self, G: Tensor, gen: torch.Generator) -> Tensor:
        raise NotImplementedError

    def end_epoch(self) -> None:
        """Called by ``HookSet.end_epoch()``; only epoch-based methods (dwa) act on it."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        pass


class Mean(Method):
    name = "mean"

    def weights(self, G, gen):
        return torch.full((len(G),), 1.0 / len(G), dtype=G.dtype)


class Sum(Method):
    name = "sum"

    def weights(self, G, gen):
        return torch.ones(len(G), dtype=G.dtype)


class Random(Method):
    """Positive random weights: a softmax of standard normal draws (RLW)."""

    name = "random"

    def weights(self, G, gen):
        return torch.softmax(torch.randn(len(G), generator=gen, dtype=G.dtype), 0)


class PCGrad(Method):
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


class MGDA(Method):
    """The min-norm point of the convex hull of the task gradients (Frank-Wolfe)."""

    name = "mgda"

    def __init__(self, epsilon: float = 0.001, max_iters: int = 100):
        self.epsilon = _check("mgda", "epsilon", epsilon, 0.0, strict=True)
        self.max_iters = int(_check("mgda", "max_iters", max_iters, 1))

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


class IMTLG(Method):
    """Impartial MTL (gradient part): equal projections of the update on every task's direction."""

    name = "imtl_g"

    def weights(self, G, gen):
        v = torch.linalg.pinv(G) @ torch.sqrt(torch.diagonal(G))
        s = v.sum()
        return torch.zeros_like(v) if s.abs() < 1e-12 else v / s


class AlignedMTL(Method):
    """Aligned-MTL: the task gradients made orthogonal with equal norms (scaled by an eigenvalue)."""

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
        lam, V = torch.linalg.eigh(G, UPLO="U")
        tol = lam.max() * k * torch.finfo(G.dtype).eps
        rank = int((lam > tol).sum())
        if rank == 0:
            return torch.full((k,), 1.0 / k, dtype=G.dtype)
        order = torch.argsort(lam, descending=True)[:rank]
        lam, V = lam[order], V[:, order]
        scale = {"min": lam[-1], "median": torch.median(lam), "rmse": lam.mean()}[self.scale_mode]
        B = scale.sqrt() * (V / lam.sqrt()) @ V.T
        return B @ torch.full((k,), 1.0 / k, dtype=G.dtype)


class _DualCone(Method):
    """Projections onto the dual cone of the task gradients, as bound-constrained QPs on the
    normalised, regularised Gramian (exact active-set solves)."""

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
        w = sum(solvers.bound_qp(H, np.eye(k)[i] / k) for i in range(k))
        return torch.from_numpy(np.asarray(w, dtype=np.float64)).to(G.dtype)


class DualProj(_DualCone):
    """The mean gradient projected onto the dual cone of the task gradients."""

    name = "dualproj"

    def weights(self, G, gen):
        H, k = self._H(G), len(G)
        return torch.from_numpy(solvers.bound_qp(H, np.full(k, 1.0 / k))).to(G.dtype)


class CAGrad(Method):
    """Conflict-averse gradient: the update in a ball of radius ``c |g_0|`` around the mean that
    maximises the worst task's improvement (a cone program; Clarabel)."""

    name = "cagrad"

    def __init__(self, c: float = 0.5, norm_eps: float = 0.0001):
        self.c = _check("cagrad", "c", c, 0.0)
        self.norm_eps = _check("cagrad", "norm_eps", norm_eps, 0.0)
        _needs("cagrad", ["clarabel", "scipy"], 'pip install clarabel scipy, or "torchjd[cagrad]"')

    def weights(self, G, gen):
        return torch.from_numpy(solvers.cagrad_socp(G.numpy(), self.c, self.norm_eps)).to(G.dtype)


class GradVac(Method):
    """Gradient Vaccine: each task's gradient pulled towards a running target cosine with the
    others (random order), from the Gramian; the EMA of the cosines is its state."""

    name = "gradvac"

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


class NashMTL(Method):
    """Nash-MTL: the bargaining solution ``G w = 1 / w`` by a sequence of convex programs
    (cvxpy, ECOS); the update's norm capped at ``max_norm`` (0: no cap)."""

    name = "nash_mtl"

    def __init__(self, max_norm: float = 1.0, update_weights_every: int = 1, optim_niter: int = 20):
        self.max_norm = _check("nash_mtl", "max_norm", max_norm, 0.0)
        self.every = int(_check("nash_mtl", "update_weights_every", update_weights_every, 1))
        self.niter = int(_check("nash_mtl", "optim_niter", optim_niter, 1))
        _needs("nash_mtl", ["cvxpy", "ecos"], 'pip install cvxpy ecos, or "torchjd[nash_mtl]"')
        self.step = 0
        self.alpha: np.ndarray | None = None  # the last weights (float32, as the reference keeps them)
        self._problem = None

    def _build(self, k: int) -> None:
        import cvxpy as cp

        a = cp.Variable(k, nonneg=True)
        prev = cp.Parameter(k, value=self.alpha)
        G = cp.Parameter((k, k), value=np.eye(k))
        norm = cp.Parameter(1, value=np.ones(1))
        lin = (1 / prev + (1 / (G @ prev)) @ G) @ (a - prev)  # linearisation of sum log(G a) around prev
        Ga = G @ a
        cons = [-cp.log(a[i] * norm) - cp.log(Ga[i]) <= 0 for i in range(k)]
        self._problem = (cp.Problem(cp.Minimize(cp.sum(Ga) + lin / norm), cons), a, prev, G, norm)

    def _solve(self, gtg: np.ndarray, norm: np.ndarray) -> np.ndarray:
        import cvxpy as cp

        prob, a, prev, G, norm_p = self._problem
        G.value, norm_p.value = gtg, norm
        alpha = self.alpha
        for _ in range(self.niter):
            a.value, prev.value = alpha, alpha
            try:
                with warnings.catch_warnings():  # the linearised problem is not DPP: cvxpy says so each solve
                    warnings.filterwarnings("ignore", message=".*not DPP.*")
                    prob.solve(solver=cp.ECOS, warm_start=True, max_iters=100)
            except (cp.SolverError, ValueError):
                a.value = prev.value
            if (
                a.value is None
                or np.linalg.norm(gtg @ alpha - 1 / (alpha + 1e-10)) < 1e-3
                or np.linalg.norm(a.value - prev.value) < 1e-6
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

    def state_dict(self):
        return {"step": self.step, "alpha": None if self.alpha is None else self.alpha.copy()}

    def load_state_dict(self, state):
        self.step = state["step"]
        self.alpha = None if state["alpha"] is None else np.array(state["alpha"])
        self._problem = None


class GradDrop(Method):
    """Gradient sign dropout: per coordinate, keep the positive or the negative parts of the
    task gradients, chosen at random by their sign purity. Needs the task gradients."""

    kind = "jacobian"
    name = "graddrop"

    def __init__(self, leak: list[float] | None = None):
        self.leak = None if leak is None else [_check("graddrop", "leak", v, 0.0, high=1.0) for v in leak]

    def aggregate(self, J: Tensor, U: Tensor) -> Tensor:
        """``J``: [k, D] task gradients; ``U``: [D] uniform draws."""
        leak = J.new_zeros(len(J)) if self.leak is None else J.new_tensor(self.leak)
        if self.leak is not None and len(self.leak) != len(J):
            raise ValueError(f"per_loss method 'graddrop': leak has {len(self.leak)} values for {len(J)} losses")
        P = 0.5 * (1.0 + J.sum(0) / J.abs().sum(0))
        out = torch.zeros_like(J[0])
        for i in range(len(J)):
            keep = (P > U) * (J[i] > 0) + (P < U) * (J[i] < 0)
            out += (leak[i] + (1 - leak[i]) * keep) * J[i]
        return out


# ---- loss weightings: weights from the loss values (detached, float64, host) ----


class LossWeighting(Method):
    kind = "losses"

    def loss_weights(self, losses: Tensor, gen: torch.Generator) -> Tensor:
        raise NotImplementedError


class GeometricMean(LossWeighting):
    """The gradient of ``(prod_i L_i)^(1/k)``: weights ``GM / (k L_i)``."""

    name = "geometric_mean"

    def loss_weights(self, losses, gen):
        if (losses < 0).any():
            raise ValueError("per_loss method 'geometric_mean': a loss is negative; it needs losses >= 0")
        gm = torch.exp(torch.log(losses).mean())
        return gm / (len(losses) * losses)


class UW(LossWeighting):
    """Uncertainty weighting: ``sum_i 0.5 exp(-s_i) L_i + 0.5 s_i``; the log-variances ``s`` are
    learned by an Adam of their own (``lr``), stepped at each backward."""

    name = "uw"

    def __init__(self, lr: float = 0.001):
        self.lr = _check("uw", "lr", lr, 0.0)
        self.log_var: Tensor | None = None
        self._opt: torch.optim.Adam | None = None

    def _setup(self, k: int, dtype) -> None:
        if self.log_var is None:
            self.log_var = torch.zeros(k, dtype=dtype, requires_grad=True)
        if self._opt is None:
            self._opt = torch.optim.Adam([self.log_var], lr=self.lr)

    def loss_weights(self, losses, gen):
        self._setup(len(losses), losses.dtype)
        s = self.log_var.detach()
        w = 0.5 * torch.exp(-s)
        self.log_var.grad = (0.5 - w * losses).to(self.log_var.dtype)  # d/ds of the scalarised loss
        self._opt.step()
        self.log_var.grad = None
        return w

    def state_dict(self):
        return {
            "log_var": None if self.log_var is None else self.log_var.detach().clone(),
            "adam": None if self._opt is None else self._opt.state_dict(),
        }

    def load_state_dict(self, state):
        if state["log_var"] is None:
            return
        self.log_var = state["log_var"].clone().requires_grad_(True)
        self._opt = torch.optim.Adam([self.log_var], lr=self.lr)
        self._opt.load_state_dict(state["adam"])


class FAMO(LossWeighting):
    """Fast adaptive multitask optimisation: the gradient of ``c sum_i z_i log(L_i - b_i + eps)``,
    ``z = softmax(logits)``; the logits take an Adam step on the change of the log losses
    between consecutive backward calls (the next batch's losses stand in for a second forward
    on the same batch)."""

    name = "famo"
    EPS = 1e-8

    def __init__(self, lr: float = 0.025, weight_decay: float = 0.001, min_losses: list[float] | None = None):
        self.lr = _check("famo", "lr", lr, 0.0)
        self.weight_decay = _check("famo", "weight_decay", weight_decay, 0.0)
        self.min_losses = None if min_losses is None else [float(v) for v in min_losses]
        self.logits: Tensor | None = None
        self.prev: Tensor | None = None
        self._opt: torch.optim.Adam | None = None

    def _shifted(self, losses: Tensor) -> Tensor:
        low = 0.0 if self.min_losses is None else losses.new_tensor(self.min_losses)
        return losses - low + self.EPS

    def update(self, losses: Tensor) -> None:
        """One Adam step of the logits from the previous losses to these."""
        delta = torch.log(self._shifted(self.prev)) - torch.log(self._shifted(losses))
        with torch.enable_grad():
            z = torch.softmax(self.logits, 0)
            (grad,) = torch.autograd.grad(z, self.logits, grad_outputs=delta.to(z.dtype))
        if self._opt is None:
            self._opt = torch.optim.Adam([self.logits], lr=self.lr, weight_decay=self.weight_decay)
        self.logits.grad = grad
        self._opt.step()
        self.logits.grad = None

    def loss_weights(self, losses, gen):
        if self.logits is None:
            self.logits = torch.zeros(len(losses), dtype=torch.float32, requires_grad=True)
        if self.prev is not None:
            self.update(losses)
        self.prev = losses.clone()
        z = torch.softmax(self.logits.detach(), 0).to(losses.dtype)
        shifted = self._shifted(losses)
        return z / (z / shifted).sum() / shifted

    def state_dict(self):
        return {
            "logits": None if self.logits is None else self.logits.detach().clone(),
            "prev": None if self.prev is None else self.prev.clone(),
            "adam": None if self._opt is None else self._opt.state_dict(),
        }

    def load_state_dict(self, state):
        self.prev = None if state["prev"] is None else state["prev"].clone()
        self.logits = None if state["logits"] is None else state["logits"].clone().requires_grad_(True)
        self._opt = None
        if state["adam"] is not None:
            self._opt = torch.optim.Adam([self.logits], lr=self.lr, weight_decay=self.weight_decay)
            self._opt.load_state_dict(state["adam"])


class DWA(LossWeighting):
    """Dynamic weight average: ``k softmax(r / T)``, ``r`` the ratio of the last two epochs' mean
    losses (uniform until two epochs are done); ``HookSet.end_epoch()`` closes an epoch."""

    name = "dwa"

    def __init__(self, temperature: float = 2.0):
        self.temperature = _check("dwa", "temperature", temperature, 0.0, strict=True)
        self.sum: Tensor | None = None
        self.batches = 0
        self.averages: list[Tensor] = []

    def loss_weights(self, losses, gen):
        if len(self.averages) < 2:
            w = torch.ones_like(losses)
        else:
            w = len(losses) * torch.softmax(self.averages[1] / self.averages[0] / self.temperature, 0)
        self.sum = losses.clone() if self.sum is None else self.sum + losses
        self.batches += 1
        return w

    def end_epoch(self) -> None:
        if self.sum is not None:
            self.averages = [*self.averages, self.sum / self.batches][-2:]
        self.sum, self.batches = None, 0

    def state_dict(self):
        return {"sum": self.sum, "batches": self.batches, "averages": list(self.averages)}

    def load_state_dict(self, state):
        self.sum, self.batches, self.averages = state["sum"], state["batches"], list(state["averages"])


# The shipped methods, in the order ``names`` lists them (``gradmod.hooks.catalog`` registers them).
SHIPPED = (
    Mean,
    Sum,
    Random,
    PCGrad,
    MGDA,
    IMTLG,
    AlignedMTL,
    UPGrad,
    DualProj,
    CAGrad,
    GradVac,
    NashMTL,
    GradDrop,
    GeometricMean,
    UW,
    FAMO,
    DWA,
)
