"""The per_loss loss weightings: weights from the loss values alone (detached, float64, host).

The update is the gradient of ``sum_i w_i L_i``; no task gradient is formed. ``mean``,
``sum``, ``fixed`` and ``random`` need no loss value either (``reads_losses = False``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from gradmod.hooks.per_loss.methods.bases import LossWeighting, _check, _one_per_task, _per_task
from gradmod.hooks.validators import LOG_START, LOG_STEP, MAX_STEP


class Mean(LossWeighting):
    """``1/k`` per task. Weights that need no task gradient: the stage runs it as a loss
    weighting (one ordinary backward); ``weights`` gives the same from a Gramian."""

    reads_losses = False
    name = "mean"

    def weights(self, G, gen):
        return torch.full((len(G),), 1.0 / len(G), dtype=G.dtype)

    def loss_weights(self, losses, gen):
        return [1.0 / len(losses)] * len(losses)


class Sum(LossWeighting):
    """``1`` per task: the plain sum (``+hooks=mtl_sum``), one ordinary backward."""

    reads_losses = False
    name = "sum"

    def weights(self, G, gen):
        return torch.ones(len(G), dtype=G.dtype)

    def loss_weights(self, losses, gen):
        return [1.0] * len(losses)


class Fixed(LossWeighting):
    """Given weights: ``weights`` maps each task's name to its weight, or lists them in the
    losses' order; a loss weighting (one ordinary backward of ``sum_i w_i L_i``)."""

    reads_losses = False
    name = "fixed"

    def __init__(self, weights: Mapping[str, float] | Sequence[float]):
        what = "per_loss method 'fixed': weights"
        if isinstance(weights, Mapping):
            items = [(str(n), v) for n, v in weights.items()]
        elif isinstance(weights, Sequence) and not isinstance(weights, str):
            items = [(str(i), v) for i, v in enumerate(weights)]
        else:
            raise ValueError(
                f"{what}={weights!r}; give a mapping of task name to weight, or a list in the losses' order"
            )
        if not items:
            raise ValueError(f"{what} is empty; give one weight per task")
        checked = {n: _check("fixed", f"weights[{n}]", v, -math.inf) for n, v in items}
        self.by_name: dict[str, float] | None = checked if isinstance(weights, Mapping) else None
        self.listed = list(checked.values())
        self._names: list[str] | None = None

    def set_tasks(self, names: list[str]) -> None:
        if self.by_name is None:
            self._count(len(names))
        else:
            missing = [n for n in names if n not in self.by_name]
            unknown = [n for n in self.by_name if n not in names] if self._names is None else []
            if missing or unknown:
                raise ValueError(
                    f"per_loss method 'fixed': weights name {', '.join(self.by_name)}, the losses are "
                    f"{', '.join(names)}; give one weight per loss, by its name"
                )
        self._names = list(names)

    def loss_weights(self, losses, gen):
        if self.by_name is not None and self._names is not None:
            return [self.by_name[n] for n in self._names]
        self._count(len(losses))
        return self.listed

    def _count(self, k: int) -> None:
        if len(self.listed) != k:
            raise ValueError(
                f"per_loss method 'fixed': {len(self.listed)} weights for {k} losses; give one per loss "
                "(in the losses' order), or a mapping of task name to weight"
            )


class Random(LossWeighting):
    """Positive random weights: a softmax of standard normal draws (RLW); a loss weighting."""

    reads_losses = False
    name = "random"

    def weights(self, G, gen):
        return torch.softmax(torch.randn(len(G), generator=gen, dtype=G.dtype), 0)

    def loss_weights(self, losses, gen):
        return torch.softmax(torch.randn(len(losses), generator=gen, dtype=losses.dtype), 0)


class HostAdam:
    """Adam (Kingma and Ba 2015, with torch's L2 ``weight_decay``) on a loss weighting's k numbers
    (log-variances, logits), kept as host floats (float64): torch's optimizer costs 30 to 70 us
    of host time a step on them, a loss weighting's largest cost. Its ``state_dict`` has
    ``torch.optim.Adam``'s layout, so either one's checkpoint resumes the other."""

    BETAS = (0.9, 0.999)
    EPS = 1e-8

    def __init__(self, values: list[float], lr: float, weight_decay: float = 0.0):
        self.values, self.lr, self.weight_decay = [float(v) for v in values], lr, weight_decay
        self.steps = 0
        self.exp_avg = [0.0] * len(values)
        self.exp_avg_sq = [0.0] * len(values)

    def step(self, grad: list[float]) -> None:
        b1, b2 = self.BETAS
        self.steps += 1
        c1, c2 = 1.0 - b1**self.steps, 1.0 - b2**self.steps
        for i, g in enumerate(grad):
            g += self.weight_decay * self.values[i]
            self.exp_avg[i] = b1 * self.exp_avg[i] + (1.0 - b1) * g
            self.exp_avg_sq[i] = b2 * self.exp_avg_sq[i] + (1.0 - b2) * g * g
            self.values[i] -= self.lr * (self.exp_avg[i] / c1) / (math.sqrt(self.exp_avg_sq[i] / c2) + self.EPS)

    def state_dict(self) -> dict:
        f64 = torch.float64
        state = (
            {}
            if self.steps == 0
            else {
                0: {
                    "step": torch.tensor(float(self.steps), dtype=f64),
                    "exp_avg": torch.tensor(self.exp_avg, dtype=f64),
                    "exp_avg_sq": torch.tensor(self.exp_avg_sq, dtype=f64),
                }
            }
        )
        group = {"lr": self.lr, "betas": self.BETAS, "eps": self.EPS, "weight_decay": self.weight_decay}
        return {"state": state, "param_groups": [{**group, "amsgrad": False, "maximize": False, "params": [0]}]}

    def load_state_dict(self, state: dict) -> None:
        mine = state["state"].get(0)
        if mine is None:
            self.steps, self.exp_avg, self.exp_avg_sq = 0, [0.0] * len(self.values), [0.0] * len(self.values)
            return
        self.steps = int(float(mine["step"]))
        self.exp_avg = [float(v) for v in mine["exp_avg"].tolist()]
        self.exp_avg_sq = [float(v) for v in mine["exp_avg_sq"].tolist()]


class GeometricMean(LossWeighting):
    """The gradient of ``(prod_i L_i)^(1/k)``: weights ``GM / (k L_i)``."""

    name = "geometric_mean"

    def loss_weights(self, losses, gen):
        values = losses.tolist()  # k host floats: Python's math costs less than a torch op each
        if min(values) < 0:
            raise ValueError("per_loss method 'geometric_mean': a loss is negative; it needs losses >= 0")
        k = len(values)
        gm = math.exp(math.fsum(math.log(v) if v > 0 else -math.inf for v in values) / k)
        return [gm / (k * v) if v > 0 else math.nan for v in values]  # 0/0 for a zero loss


class UW(LossWeighting):
    """Uncertainty weighting: ``sum_i 0.5 exp(-s_i) L_i + 0.5 s_i``; the log-variances ``s`` are
    learned by an Adam of their own (``lr``), stepped at each backward, from ``init`` (0, as
    torchjd; LibMTL starts at -0.5)."""

    name = "uw"
    per_task_state = True

    def __init__(self, lr: float = 0.001, init: float = 0.0):
        self.lr = _check("uw", "lr", lr, 0.0, high=LOG_STEP)
        self.init = _check("uw", "init", init, -LOG_START, high=LOG_START)
        self._adam: HostAdam | None = None  # its values: the log-variances

    @property
    def log_var(self) -> Tensor | None:
        return None if self._adam is None else torch.tensor(self._adam.values, dtype=torch.float64)

    def loss_weights(self, losses, gen):
        if self._adam is None:
            self._adam = HostAdam([self.init] * len(losses), self.lr)
        w = [0.5 * math.exp(-s) for s in self._adam.values]
        self._adam.step([0.5 - wi * v for wi, v in zip(w, losses.tolist())])  # d/ds of the scalarised loss
        return w

    def state_dict(self):
        return {"log_var": self.log_var, "adam": None if self._adam is None else self._adam.state_dict()}

    def load_state_dict(self, state):
        if state["log_var"] is None:
            return
        self._adam = HostAdam(state["log_var"].tolist(), self.lr)
        self._adam.load_state_dict(state["adam"])


class FAMO(LossWeighting):
    """Fast adaptive multitask optimisation: the gradient of ``c sum_i z_i log(L_i - b_i + eps)``,
    ``z = softmax(logits)``; the logits take an Adam step on the fall of the log losses over
    an optimizer step. ``update_from``: ``same_batch`` (as its authors define it) compares the
    step's losses with the same batch's losses after the step, which ``after_step`` brings
    (the trainer computes them in a second forward without gradients; in one's own loop call
    ``hooks.after_step(losses)`` after ``optimizer.step()``); ``next_batch`` uses the
    next backward's losses instead (no second forward; a different batch)."""

    name = "famo"
    per_task_state = True
    EPS = 1e-8
    UPDATES = ("same_batch", "next_batch")

    def __init__(
        self,
        lr: float = 0.025,
        weight_decay: float = 0.001,
        min_losses: list[float] | None = None,
        update_from: str = "same_batch",
    ):
        self.lr = _check("famo", "lr", lr, 0.0, high=MAX_STEP)
        self.weight_decay = _check("famo", "weight_decay", weight_decay, 0.0, high=MAX_STEP)
        self.min_losses = None if min_losses is None else _per_task("famo", "min_losses", min_losses, -math.inf)
        if update_from not in self.UPDATES:
            raise ValueError(f"per_loss method 'famo': update_from={update_from!r}; allowed: {', '.join(self.UPDATES)}")
        self.update_from = update_from
        self._adam: HostAdam | None = None  # its values: the logits
        self.prev: list[float] | None = None  # the step's losses, until the losses after it come

    @property
    def logits(self) -> Tensor | None:
        return None if self._adam is None else torch.tensor(self._adam.values, dtype=torch.float64)

    @property
    def wants_after_step(self) -> bool:
        return self.update_from == "same_batch"

    def _shifted(self, losses: list[float]) -> list[float]:
        """``L_i - b_i + eps``: each loss above its lower bound (``min_losses``, else 0)."""
        low = [0.0] * len(losses) if self.min_losses is None else self.min_losses
        return [v - b + self.EPS for v, b in zip(losses, low)]

    def _log_shifted(self, losses: list[float]) -> list[float]:
        """``log(L_i - b_i + eps)``, nan below the bound (as torch's log)."""
        return [_log(v) for v in self._shifted(losses)]

    def update(self, losses: list[float]) -> None:
        """One Adam step of the logits from the previous losses to these."""
        assert self._adam is not None and self.prev is not None
        delta = [a - b for a, b in zip(self._log_shifted(self.prev), self._log_shifted(losses))]
        z = _softmax(self._adam.values)
        mean = math.fsum(d * zi for d, zi in zip(delta, z))
        self._adam.step([zi * (d - mean) for zi, d in zip(z, delta)])  # delta through the softmax's Jacobian

    def after_step(self, losses: Tensor) -> None:
        """``same_batch``: the step's batch's losses after the optimizer step (on the host)."""
        values = losses.tolist()
        if self.update_from == "same_batch" and self.prev is not None and all(map(math.isfinite, values)):
            self.update(values)
            self.prev = None

    def set_tasks(self, names: list[str]) -> None:
        _one_per_task("famo", "min_losses", self.min_losses, len(names))

    def loss_weights(self, losses, gen):
        values = losses.tolist()  # k host floats, as geometric_mean
        if self._adam is None:
            self._adam = HostAdam([0.0] * len(values), self.lr, self.weight_decay)
        if self.update_from == "next_batch" and self.prev is not None:
            self.update(values)
        self.prev = values
        z = _softmax(self._adam.values)
        shifted = self._shifted(values)
        total = math.fsum(zi / si for zi, si in zip(z, shifted))
        return [zi / total / si for zi, si in zip(z, shifted)]

    def state_dict(self):
        started = self._adam is not None and self._adam.steps > 0
        return {
            "logits": self.logits,
            "prev": None if self.prev is None else torch.tensor(self.prev, dtype=torch.float64),
            "adam": self._adam.state_dict() if started else None,
        }

    def load_state_dict(self, state):
        self.prev = None if state["prev"] is None else [float(v) for v in state["prev"].tolist()]
        self._adam = None
        if state["logits"] is not None:
            self._adam = HostAdam(state["logits"].tolist(), self.lr, self.weight_decay)
            if state["adam"] is not None:
                self._adam.load_state_dict(state["adam"])


def _log(x: float) -> float:
    return math.log(x) if x > 0 else (-math.inf if x == 0 else math.nan)


def _softmax(values: list[float]) -> list[float]:
    top = max(values)
    e = [math.exp(v - top) for v in values]
    total = math.fsum(e)
    return [v / total for v in e]


class DWA(LossWeighting):
    """Dynamic weight average: ``k softmax(r / T)``, ``r`` the ratio of the last two epochs' mean
    losses (uniform until two epochs are done); ``HookSet.end_epoch()`` closes an epoch."""

    name = "dwa"
    per_task_state = True

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
