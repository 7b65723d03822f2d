"""torchjd's scalarizations (``torchjd.scalarization``) as loss weightings: COSMOS, IMTL-L,
PBI and STCH. A scalarization ``f(L)`` of the k losses has the gradient
``sum_i (df/dL_i) grad L_i``, so its weights are ``df/dL_i`` at the step's losses (host
floats, float64) and the update one ordinary backward of ``sum_i w_i L_i``.

A preference vector (``weights``) is a list with one number per loss, or ``dirichlet``: a
fresh draw from ``Dirichlet(concentration)`` at each backward, from the stage's generator, as
COSMOS's and PBI's authors do to cover the Pareto front (torchjd leaves the draw to its user).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from gradmod.hooks.per_loss.methods.bases import LossWeighting, _check, _one_per_task, _per_task
from gradmod.hooks.per_loss.methods.loss_weightings import HostAdam
from gradmod.hooks.validators import LOG_START, LOG_STEP, MAX_STEP

COS_EPS = 1e-8  # torch's cosine_similarity: each vector over max(|v|, eps)
PBI_EPS = 1e-12  # torchjd's PBI: under the root of d2, so its gradient stays finite on the direction


class _Preferring(LossWeighting):
    """A scalarization with a preference vector (``weights``) and a reference point."""

    def __init__(self, weights: Any, concentration: float, reference: list[float] | None):
        name = self.name
        self.preference: list[float] | None = None
        if isinstance(weights, str) and weights != "dirichlet":
            raise ValueError(
                f"per_loss method {name!r}: weights={weights!r}; give a list of numbers, one per loss, or dirichlet"
            )
        if weights is not None and weights != "dirichlet":
            self.preference = _per_task(name, "weights", weights, -math.inf)
        self.draws = weights == "dirichlet"
        self.concentration = _check(name, "concentration", concentration, 0.0, strict=True)
        self.reference = None if reference is None else _per_task(name, "reference", reference, -math.inf)

    def set_tasks(self, names: list[str]) -> None:
        _one_per_task(self.name, "weights", self.preference, len(names))
        _one_per_task(self.name, "reference", self.reference, len(names))

    def _prefer(self, k: int, gen: torch.Generator) -> list[float]:
        """The preference vector of this step: the given one, or a Dirichlet draw."""
        if self.draws:
            alpha = torch.full((k,), self.concentration, dtype=torch.float64)
            return torch._sample_dirichlet(alpha, generator=gen).tolist()
        return self.preference if self.preference is not None else [1.0 / k] * k

    def _shifted(self, losses: Tensor) -> list[float]:
        values = losses.tolist()
        return values if self.reference is None else [v - z for v, z in zip(values, self.reference)]


class COSMOS(_Preferring):
    """COSMOS (Ruchte and Grabocka 2021, torchjd's ``COSMOS``): ``sum_i r_i L_i - lambda_ cos(r, L)``,
    the preference ``r`` given (``weights``) or drawn each step (``weights: dirichlet``)."""

    name = "cosmos"

    def __init__(self, lambda_: float, weights: Any, concentration: float = 1.0):
        self.lambda_ = _check("cosmos", "lambda_", lambda_, 0.0, high=MAX_STEP)
        super().__init__(weights, concentration, None)

    def loss_weights(self, losses, gen):
        L = losses.tolist()
        r = self._prefer(len(L), gen)
        nr, nL = math.sqrt(math.fsum(v * v for v in r)), math.sqrt(math.fsum(v * v for v in L))
        ru = [v / max(nr, COS_EPS) for v in r]
        if nL > COS_EPS:  # d cos / dL = r^ / |L| - cos L / |L|^2
            cos = math.fsum(a * b for a, b in zip(ru, L)) / nL
            grad = [a / nL - cos * b / nL**2 for a, b in zip(ru, L)]
        else:  # |L| clamped at eps: cos = r^ . L / eps
            grad = [a / COS_EPS for a in ru]
        return [a - self.lambda_ * g for a, g in zip(r, grad)]


class IMTLL(LossWeighting):
    """IMTL-L (Liu et al. 2021, torchjd's ``IMTLL``): ``sum_i exp(s_i) L_i - s_i``; the scales
    ``s`` learned by an Adam of their own (``lr``), stepped at each backward, from ``init``."""

    name = "imtll"
    per_task_state = True

    def __init__(self, lr: float = 0.001, init: float = 0.0):
        self.lr = _check("imtll", "lr", lr, 0.0, high=LOG_STEP)
        self.init = _check("imtll", "init", init, -LOG_START, high=LOG_START)
        self._adam: HostAdam | None = None  # its values: the log-scales

    @property
    def log_scale(self) -> Tensor | None:
        return None if self._adam is None else torch.tensor(self._adam.values, dtype=torch.float64)

    def loss_weights(self, losses, gen):
        if self._adam is None:
            self._adam = HostAdam([self.init] * len(losses), self.lr)
        w = [math.exp(s) for s in self._adam.values]
        self._adam.step([wi * v - 1.0 for wi, v in zip(w, losses.tolist())])  # d/ds of the scalarised loss
        return w

    def state_dict(self):
        return {"log_scale": self.log_scale, "adam": None if self._adam is None else self._adam.state_dict()}

    def load_state_dict(self, state):
        if state["log_scale"] is None:
            return
        self._adam = HostAdam(state["log_scale"].tolist(), self.lr)
        self._adam.load_state_dict(state["adam"])


class PBI(_Preferring):
    """Penalty-based boundary intersection (Zhang and Li 2007, torchjd's ``PBI``): the distance
    ``d1`` of ``L - reference`` along the preference direction plus ``theta`` times its distance
    ``d2`` from that line."""

    name = "pbi"

    def __init__(self, theta: float, weights: Any, reference: list[float] | None = None, concentration: float = 1.0):
        self.theta = _check("pbi", "theta", theta, 0.0, high=MAX_STEP)
        super().__init__(weights, concentration, reference)

    def loss_weights(self, losses, gen):
        f = self._shifted(losses)
        r = self._prefer(len(f), gen)
        nr = math.sqrt(math.fsum(v * v for v in r))
        u = [v / nr for v in r]
        d1 = math.fsum(a * b for a, b in zip(f, u))
        perp = [a - d1 * b for a, b in zip(f, u)]
        d2 = math.sqrt(math.fsum(v * v for v in perp) + PBI_EPS)
        return [a + self.theta * p / d2 for a, p in zip(u, perp)]  # d d1/dL = u, d d2/dL = perp / d2


class STCH(_Preferring):
    """Smooth Tchebycheff (Lin et al. 2024, torchjd's ``STCH``): ``mu logsumexp(w (L - reference) / mu)``,
    a smooth weighted maximum of the losses; ``weights`` uniform by default."""

    name = "stch"

    def __init__(self, mu: float, weights: Any = None, reference: list[float] | None = None):
        self.mu = _check("stch", "mu", mu, 0.0, strict=True)
        super().__init__(weights, 1.0, reference)

    def loss_weights(self, losses, gen):
        f = self._shifted(losses)
        lam = self._prefer(len(f), gen)
        y = [a * b for a, b in zip(lam, f)]
        top = max(y)
        e = [math.exp((v - top) / self.mu) for v in y]
        total = math.fsum(e)
        return [a * v / total for a, v in zip(lam, e)]  # d/dL_i: w_i softmax(y / mu)_i
