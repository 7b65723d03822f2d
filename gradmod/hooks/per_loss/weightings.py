"""The per_loss loss weightings: weights from the loss values alone (detached, float64, host).

The update is the gradient of ``sum_i w_i L_i``; no task gradient is formed.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.optim.adam import adam

from gradmod.hooks.per_loss.methods import Method, _check


def adam_step(opt: torch.optim.Adam, grad: Tensor) -> None:
    """``opt.step()`` of its one tensor with gradient ``grad``, by torch's functional Adam on the
    optimizer's own state (its ``state_dict`` unchanged): the Optimizer's step machinery costs
    about 70 us of host time a call more, a loss weighting's largest cost per step."""
    group = opt.param_groups[0]
    (p,) = group["params"]
    state = opt.state[p]
    if not state:  # as torch.optim.Adam's first step
        default = torch.get_default_dtype()
        state["step"] = torch.tensor(0.0, dtype=torch.float64 if default == torch.float64 else torch.float32)
        state["exp_avg"] = torch.zeros_like(p)
        state["exp_avg_sq"] = torch.zeros_like(p)
    beta1, beta2 = group["betas"]
    with torch.no_grad():
        adam(
            [p],
            [grad],
            [state["exp_avg"]],
            [state["exp_avg_sq"]],
            [],
            [state["step"]],
            foreach=False,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )


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
    learned by an Adam of their own (``lr``), stepped at each backward, from ``init`` (0, as
    torchjd; LibMTL starts at -0.5)."""

    name = "uw"
    per_task_state = True

    def __init__(self, lr: float = 0.001, init: float = 0.0):
        self.lr = _check("uw", "lr", lr, 0.0)
        self.init = _check("uw", "init", init, -math.inf)
        self.log_var: Tensor | None = None
        self._opt: torch.optim.Adam | None = None

    def _setup(self, k: int, dtype) -> None:
        if self.log_var is None:
            self.log_var = torch.full((k,), self.init, dtype=dtype, requires_grad=True)
        if self._opt is None:
            self._opt = torch.optim.Adam([self.log_var], lr=self.lr)

    def loss_weights(self, losses, gen):
        self._setup(len(losses), losses.dtype)
        s = self.log_var.detach()
        w = 0.5 * torch.exp(-s)
        adam_step(self._opt, (0.5 - w * losses).to(self.log_var.dtype))  # d/ds of the scalarised loss
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
        self.lr = _check("famo", "lr", lr, 0.0)
        self.weight_decay = _check("famo", "weight_decay", weight_decay, 0.0)
        self.min_losses = None if min_losses is None else [float(v) for v in min_losses]
        if update_from not in self.UPDATES:
            raise ValueError(f"per_loss method 'famo': update_from={update_from!r}; allowed: {', '.join(self.UPDATES)}")
        self.update_from = update_from
        self.logits: Tensor | None = None
        self.prev: Tensor | None = None
        self._opt: torch.optim.Adam | None = None

    @property
    def wants_after_step(self) -> bool:
        return self.update_from == "same_batch"

    def _shifted(self, losses: Tensor) -> Tensor:
        low = 0.0 if self.min_losses is None else losses.new_tensor(self.min_losses)
        return losses - low + self.EPS

    def update(self, losses: Tensor) -> None:
        """One Adam step of the logits from the previous losses to these."""
        delta = (torch.log(self._shifted(self.prev)) - torch.log(self._shifted(losses))).to(self.logits.dtype)
        z = torch.softmax(self.logits.detach(), 0)
        grad = z * (delta - (delta * z).sum())  # delta through the softmax's Jacobian
        if self._opt is None:
            self._opt = torch.optim.Adam([self.logits], lr=self.lr, weight_decay=self.weight_decay)
        adam_step(self._opt, grad)

    def after_step(self, losses: Tensor) -> None:
        """``same_batch``: the step's batch's losses after the optimizer step (on the host)."""
        if self.update_from == "same_batch" and self.prev is not None and bool(torch.isfinite(losses).all()):
            self.update(losses)
            self.prev = None

    def loss_weights(self, losses, gen):
        if self.logits is None:
            self.logits = torch.zeros(len(losses), dtype=torch.float32, requires_grad=True)
        if self.update_from == "next_batch" and self.prev is not None:
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
