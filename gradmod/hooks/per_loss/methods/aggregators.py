"""torchjd's aggregators for conflicting and for untrusted task gradients: ConFIG, FairGrad
and Krum from the Gramian, TrimmedMean and ExcessMTL from the task gradients themselves.

Each takes torchjd 0.18's arguments; a list argument (``pref_vector``) has one number per
loss, in the losses' order. The weights come on the host in float64, as every Gramian
method's (``bases``).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from gradmod.hooks.per_loss.methods.bases import (
    Aggregator,
    GramianWeighting,
    MatrixWeighting,
    _check,
    _count,
    _needs,
    _one_per_task,
    _per_task,
)
from gradmod.hooks.per_loss.methods.rounding import rank_rtol, unit
from gradmod.hooks.validators import MAX_STEP


class ConFIG(GramianWeighting):
    """ConFIG (Liu et al. 2024, torchjd's ``ConFIG``): the direction with the same cosine with
    every unit task gradient (preferred ones more: ``pref_vector``), as long as the sum of the
    task gradients' projections on it.

    From the Gramian: the unit gradients' pseudo-inverse is ``J^T N pinv(N G N)`` (``N`` the
    inverse norms, 0 for a task without gradient), so the direction is ``J^T c`` with
    ``c = N pinv(N G N) p`` and the update ``J^T c (1^T G c) / (c^T G c)``. The eigenvalues
    of ``N G N`` below ``rank_rtol`` of the largest are its rounding, and so is a preference
    whose part in their span is below it (squared, of ``|p|^2``): unit gradients that sum to
    0 give no update, as in exact arithmetic (torchjd's float32 normalises the rounding)."""

    name = "config"

    def __init__(self, pref_vector: list[float] | None = None):
        self.pref_vector = None if pref_vector is None else _per_task("config", "pref_vector", pref_vector, -math.inf)

    def set_tasks(self, names: list[str]) -> None:
        _one_per_task("config", "pref_vector", self.pref_vector, len(names))

    def weights(self, G, gen):
        k = len(G)
        p = torch.ones(k, dtype=G.dtype) if self.pref_vector is None else torch.tensor(self.pref_vector, dtype=G.dtype)
        Gu, norms = unit(G)
        inv = torch.where(norms > 0, 1.0 / norms, torch.zeros_like(norms))
        lam, V = torch.linalg.eigh(Gu)
        rtol = rank_rtol(G)
        keep = lam > rtol * lam.max()
        q = V[:, keep].T @ p  # the preference in the span of the unit gradients
        if not bool(keep.any()) or q @ q <= rtol * (p @ p):
            return torch.zeros(k, dtype=G.dtype)
        c = inv * (V[:, keep] @ (q / lam[keep]))
        sq = (c @ G @ c).clamp(min=0.0)
        norm = sq.sqrt().clamp(min=1e-12)  # torch's normalize: the direction over max(|d|, 1e-12)
        return c * (G.sum(0) @ c) / norm**2


class FairGrad(GramianWeighting):
    """FairGrad (Ban and Ji 2024, torchjd's ``FairGrad``): alpha-fair weights, the positive
    solution of ``G w = w^(-1/alpha)`` by scipy's bounded least squares from the uniform
    weights (``max_iters`` evaluations at most; None: scipy's ``100 k``); alpha 0 is the mean."""

    name = "fairgrad"

    def __init__(self, alpha: float, max_iters: int | None = None):
        self.alpha = _check("fairgrad", "alpha", alpha, 0.0)
        self.max_iters = None if max_iters is None else _count("fairgrad", "max_iters", max_iters)
        _needs("fairgrad", ["scipy"], 'pip install scipy, or "torchjd[fairgrad]"')

    def weights(self, G, gen):
        from scipy.optimize import least_squares

        k = len(G)
        uniform = np.full(k, 1.0 / k)
        if self.alpha == 0:  # linear scalarization: the mean
            return torch.from_numpy(uniform).to(G.dtype)
        g, power = G.numpy(), -1.0 / self.alpha
        res = least_squares(lambda w: g @ w - w**power, uniform, bounds=(0, np.inf), max_nfev=self.max_iters)
        return torch.from_numpy(np.asarray(res.x, dtype=np.float64)).to(G.dtype)


class Krum(GramianWeighting):
    """(Multi-)Krum (Blanchard et al. 2017, torchjd's ``Krum``): the ``n_selected`` task
    gradients whose ``k - n_byzantine - 2`` nearest others are closest, averaged; distances
    from the Gramian. Needs ``k >= n_byzantine + 3`` and ``k >= n_selected``."""

    name = "krum"

    def __init__(self, n_byzantine: int, n_selected: int = 1):
        self.n_byzantine = _count("krum", "n_byzantine", n_byzantine, 0, math.inf)
        self.n_selected = _count("krum", "n_selected", n_selected, 1, math.inf)

    def set_tasks(self, names: list[str]) -> None:
        need = max(self.n_byzantine + 3, self.n_selected)
        if len(names) < need:
            raise ValueError(
                f"per_loss method 'krum': n_byzantine={self.n_byzantine}, n_selected={self.n_selected} need "
                f"at least {need} losses, got {len(names)}"
            )

    def weights(self, G, gen):
        k = len(G)
        sq = torch.diagonal(G)
        dist = (sq[None, :] + sq[:, None] - 2 * G).clamp(min=0.0).sqrt()
        near = k - self.n_byzantine - 2  # the neighbours each score sums (itself, at 0, first)
        scores = torch.sort(dist, dim=1).values[:, 1 : near + 1].sum(1)
        chosen = torch.topk(scores, self.n_selected, largest=False).indices
        w = torch.zeros(k, dtype=G.dtype)
        w[chosen] = 1.0 / self.n_selected
        return w


class TrimmedMean(Aggregator):
    """Coordinate-wise trimmed mean (Yin et al. 2018, torchjd's ``TrimmedMean``): per
    coordinate, the ``trim_number`` largest and smallest task gradients dropped, the rest
    averaged. Needs ``k >= 2 trim_number + 1``."""

    name = "trimmed_mean"

    def __init__(self, trim_number: int):
        self.trim_number = _count("trimmed_mean", "trim_number", trim_number, 0, math.inf)

    def set_tasks(self, names: list[str]) -> None:
        if len(names) < 2 * self.trim_number + 1:
            raise ValueError(
                f"per_loss method 'trimmed_mean': trim_number={self.trim_number} needs at least "
                f"{2 * self.trim_number + 1} losses, got {len(names)}"
            )

    def aggregate(self, J: Tensor, U: Tensor) -> Tensor:
        t = self.trim_number
        return torch.sort(J, dim=0).values[t : len(J) - t].mean(0)


class ExcessMTL(MatrixWeighting):
    """ExcessMTL (He et al. 2024, torchjd's ``ExcessMTL``): weights moved by an exponentiated
    gradient step (``robust_step_size``) towards the tasks of largest excess risk.

    The excess risk: each task gradient's squares over an AdaGrad-like root of the sum of
    the squares so far (per coordinate: the state is k times the rule's size), relative to
    the first step's (or the mean of ``n_warmup_steps`` steps' with uniform weights)."""

    name = "excess_mtl"
    per_task_state = True

    def __init__(self, robust_step_size: float = 1.0, n_warmup_steps: int = 0):
        self.robust_step_size = _check(
            "excess_mtl", "robust_step_size", robust_step_size, 0.0, strict=True, high=MAX_STEP
        )
        self.n_warmup_steps = _count("excess_mtl", "n_warmup_steps", n_warmup_steps, 0, math.inf)
        self.reset()

    def reset(self) -> None:
        self.w: Tensor | None = None  # the weights, on the simplex
        self.sq_sum: Tensor | None = None  # [k, D] the squared task gradients summed over the steps
        self.baseline: Tensor | None = None  # the excess risks the later ones are relative to
        self.warmup_sum: Tensor | None = None
        self.steps = 0

    def matrix_weights(self, J: Tensor) -> Tensor:
        self._start(J)
        assert self.w is not None and self.sq_sum is not None and self.warmup_sum is not None
        sq = J.detach() ** 2
        self.sq_sum += sq
        excess = (sq / torch.sqrt(self.sq_sum + 1e-7)).sum(1)  # g_i^T H_i^-1 g_i, H diagonal (AdaGrad)
        self.steps += 1
        if self.steps <= self.n_warmup_steps:  # uniform weights while the baseline is gathered
            self.warmup_sum += excess
            return self.w
        if self.baseline is None:
            warm = self.n_warmup_steps > 0
            self.baseline = self.warmup_sum / self.n_warmup_steps if warm else excess
            excess = excess / (self.baseline + 1e-7) if warm else excess
        else:
            excess = excess / (self.baseline + 1e-7)
        self.w = torch.softmax(torch.log(self.w) + self.robust_step_size * excess, 0)  # in log space: no overflow
        return self.w

    def _start(self, J: Tensor) -> None:
        """Fresh state at the first step, and for task gradients of another size (as torchjd);
        a resumed state moves to the gradients' device and dtype."""
        if self.sq_sum is not None and self.sq_sum.shape == J.shape:
            for key in _TENSORS:
                value = getattr(self, key)
                if value is not None:
                    setattr(self, key, value.to(J.device, J.dtype))
            return
        k = len(J)
        self.reset()
        self.sq_sum = torch.zeros_like(J)
        self.warmup_sum = J.new_zeros(k)
        self.w = J.new_full((k,), 1.0 / k)

    def state_dict(self):
        return {**{key: getattr(self, key) for key in _TENSORS}, "steps": self.steps}

    def load_state_dict(self, state):
        for key in _TENSORS:
            setattr(self, key, state[key])
        self.steps = int(state["steps"])


_TENSORS = ("w", "sq_sum", "baseline", "warmup_sum")  # ExcessMTL's state besides its step count
