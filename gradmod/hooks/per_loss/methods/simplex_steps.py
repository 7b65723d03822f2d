"""Weightings learned across steps by projected gradient steps on the simplex: MoDo and
SDMGrad (torchjd's ``MoDoWeighting`` and ``SDMGradWeighting``), and CR-MOGM's smoothing of
any other method's weights (``crmogm``).

MoDo and SDMGrad are defined on ``J_1 J_2^T``, the task gradients of two independent batches;
the per_loss stage sees one batch per backward, so they take the step's Gramian ``J J^T``
(the matrix torchjd's weightings accept as well, without the convergence guarantee of the
two-batch form). Their state: the weights, on the host in float64.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from gradmod.hooks.per_loss.methods import bases as M
from gradmod.hooks.per_loss.methods.bases import GramianWeighting, _check, _count, _one_per_task, _per_task
from gradmod.hooks.validators import MAX_STEP


def project_onto_simplex(y: Tensor) -> Tensor:
    """The Euclidean projection onto ``{x >= 0, sum x = 1}`` (Held et al. 1974): ``y - t``
    clipped at 0, ``t`` the first of the sorted running means ``(sum_{j <= i} y_(j) - 1) / i``
    above the next value (``(sum y - 1) / k`` where none is)."""
    s = torch.sort(y, descending=True).values
    t = (torch.cumsum(s, 0) - 1.0) / torch.arange(1, len(y) + 1, dtype=y.dtype)
    above = torch.nonzero(t[:-1] > s[1:]).flatten()
    shift = t[int(above[0])] if len(above) else (y.sum() - 1.0) / len(y)
    return (y - shift).clamp(min=0.0)


class MoDo(GramianWeighting):
    """MoDo (Chen et al. 2024, torchjd's ``MoDoWeighting``): the weights take one projected
    gradient step on the simplex each backward, ``w <- proj(w - gamma (G w + rho w))``, from
    the uniform ones."""

    name = "modo"
    per_task_state = True

    def __init__(self, gamma: float = 0.1, rho: float = 0.1):
        self.gamma = _check("modo", "gamma", gamma, 0.0, strict=True, high=MAX_STEP)
        self.rho = _check("modo", "rho", rho, 0.0, high=MAX_STEP)
        self.w: Tensor | None = None  # the weights, float64 on the host

    def weights(self, G, gen):
        w = _start(self.w, len(G))
        self.w = project_onto_simplex(w - self.gamma * (G @ w + self.rho * w))
        return self.w.clone()

    def state_dict(self):
        return {"w": self.w}

    def load_state_dict(self, state):
        self.w = state["w"]


class SDMGrad(GramianWeighting):
    """SDMGrad (Xiao et al. 2023, torchjd's ``SDMGradWeighting``): an update that avoids
    conflicts, pulled towards a preferred direction (``pref_vector``, the mean by default) by
    ``lambda_``.

    Its weights: ``n_iter`` projected momentum-SGD steps on the simplex each backward (``lr``,
    ``momentum``) on the Gramian divided by the squared mean task-gradient norm, warm-started
    from the last weights."""

    name = "sdmgrad"
    per_task_state = True

    def __init__(
        self,
        lr: float = 10.0,
        momentum: float = 0.5,
        n_iter: int = 20,
        lambda_: float = 0.3,
        pref_vector: list[float] | None = None,
    ):
        self.lr = _check("sdmgrad", "lr", lr, 0.0, strict=True, high=MAX_STEP)
        self.momentum = _check("sdmgrad", "momentum", momentum, 0.0, high=math.nextafter(1.0, 0.0))
        self.n_iter = _count("sdmgrad", "n_iter", n_iter)
        self.lambda_ = _check("sdmgrad", "lambda_", lambda_, 0.0, high=MAX_STEP)
        self.pref_vector = None if pref_vector is None else _per_task("sdmgrad", "pref_vector", pref_vector, -math.inf)
        self.w: Tensor | None = None  # the weights, float64 on the host

    def set_tasks(self, names: list[str]) -> None:
        _one_per_task("sdmgrad", "pref_vector", self.pref_vector, len(names))

    def weights(self, G, gen):
        k = len(G)
        pref = (
            torch.full((k,), 1.0 / k, dtype=G.dtype)
            if self.pref_vector is None
            else torch.tensor(self.pref_vector, dtype=G.dtype)
        )
        scale = torch.diagonal(G).clamp(min=0.0).sqrt().mean()
        a = G / (scale**2 + 1e-8)
        w, velocity = _start(self.w, k), None
        for _ in range(self.n_iter):
            grad = a @ (w + self.lambda_ * pref)
            velocity = grad if velocity is None else self.momentum * velocity + grad
            w = project_onto_simplex(w - self.lr * velocity)
        self.w = w
        return (w + self.lambda_ * pref) / (1.0 + self.lambda_)

    def state_dict(self):
        return {"w": self.w}

    def load_state_dict(self, state):
        self.w = state["w"]


def _start(w: Tensor | None, k: int) -> Tensor:
    """The last weights, or the uniform ones at the first step (and for another number of tasks)."""
    return torch.full((k,), 1.0 / k, dtype=torch.float64) if w is None or len(w) != k else w


class _Smoothing:
    """CR-MOGM's moving average of another method's weights (``inner``):
    ``w_t = alpha w_(t-1) + (1 - alpha) w_hat_t``, from ``initial_weights`` or the first
    ``w_hat``. The inner method's hooks and state ride along."""

    name = "crmogm"
    per_task_state = True

    def __init__(self, inner: M.Method, alpha: float, initial_weights: list[float] | None):
        self.inner = inner
        self.alpha = alpha
        self.initial_weights = initial_weights
        self.reads_losses = inner.reads_losses
        self.lam: Tensor | None = None

    def smooth(self, w_hat: Tensor | list[float]) -> Tensor:
        w_hat = torch.as_tensor(w_hat, dtype=torch.float64)
        if self.lam is None:
            start = self.initial_weights
            self.lam = w_hat if start is None else torch.tensor(start, dtype=torch.float64).to(w_hat.device)
        self.lam = self.alpha * self.lam + (1.0 - self.alpha) * w_hat
        return self.lam

    @property
    def wants_after_step(self) -> bool:
        return self.inner.wants_after_step

    @property
    def weighs_rest(self) -> bool:
        return self.inner.weighs_rest

    def rest_weights(self) -> Tensor | None:
        return self.inner.rest_weights()

    def set_tasks(self, names: list[str]) -> None:
        _one_per_task("crmogm", "initial_weights", self.initial_weights, len(names))
        self.inner.set_tasks(names)

    def end_epoch(self) -> None:
        self.inner.end_epoch()

    def after_step(self, losses: Tensor) -> None:
        self.inner.after_step(losses)

    def state_dict(self) -> dict[str, Any]:
        return {"lambda": self.lam, "inner": self.inner.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.lam = state["lambda"]
        self.inner.load_state_dict(state["inner"])


class _SmoothedGramian(_Smoothing, GramianWeighting):
    def weights(self, G, gen):
        assert isinstance(self.inner, GramianWeighting)
        return self.smooth(self.inner.weights(G, gen)).to(G.dtype)


class _SmoothedMatrix(_Smoothing, M.MatrixWeighting):
    def matrix_weights(self, J):
        assert isinstance(self.inner, M.MatrixWeighting)
        return self.smooth(self.inner.matrix_weights(J))


class _SmoothedLosses(_Smoothing, M.LossWeighting):
    def loss_weights(self, losses, gen):
        assert isinstance(self.inner, M.LossWeighting)
        return self.smooth(self.inner.loss_weights(losses, gen))


class CRMOGM(M.Method):
    """CR-MOGM (Zhou et al. 2022, torchjd's ``CRMOGMWeighting``): another method's weights
    smoothed by a moving average across steps, ``alpha`` on the previous ones; ``weighting``
    names that method (``upgrad``, or ``{name: fairgrad, alpha: 2}``), one that gives weights.

    What it builds is of its weighting's kind: a Gramian weighting, a matrix weighting or a
    loss weighting that smooths the weighting's weights."""

    kind = "its weighting's"  # no base of its own: each instance is one of the three smoothings

    def __new__(
        cls, weighting: str | Mapping[str, Any], alpha: float = 0.9, initial_weights: list[float] | None = None
    ):  # type: ignore[misc]
        return _smoothed(weighting, alpha, initial_weights)


def _smoothed(weighting: str | Mapping[str, Any], alpha: float, initial_weights: list[float] | None) -> _Smoothing:
    """The smoothing of the weighting's kind (``CRMOGM``), its arguments checked."""
    alpha = _check("crmogm", "alpha", alpha, 0.0, high=1.0)
    start = None if initial_weights is None else _per_task("crmogm", "initial_weights", initial_weights, -math.inf)
    if isinstance(weighting, str):
        name, args = weighting, {}
    elif isinstance(weighting, Mapping) and isinstance(weighting.get("name"), str):
        name, args = weighting["name"], {k: v for k, v in weighting.items() if k != "name"}
    else:
        raise ValueError(
            f"per_loss method 'crmogm': weighting={weighting!r}; name a per_loss method (upgrad) or give "
            "it with its arguments ({name: fairgrad, alpha: 2})"
        )
    if not M.is_method(name):
        raise ValueError(
            f"per_loss method 'crmogm': weighting={name!r} is no per_loss method; allowed: {', '.join(M.names())}"
        )
    inner = M.build(name, args)
    for base, smoothed in (
        (GramianWeighting, _SmoothedGramian),
        (M.MatrixWeighting, _SmoothedMatrix),
        (M.LossWeighting, _SmoothedLosses),
    ):
        if isinstance(inner, base):
            return smoothed(inner, alpha, start)
    raise ValueError(
        f"per_loss method 'crmogm': weighting={name!r} gives an update, not weights, so there is nothing to "
        "smooth; name a Gramian method (upgrad, mgda, ...), excess_mtl or a loss weighting"
    )
