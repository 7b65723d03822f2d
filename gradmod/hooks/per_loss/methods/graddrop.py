"""GradDrop, an aggregator: the update from the task gradients themselves, per coordinate
(``methods.Aggregator``)."""

from __future__ import annotations

import torch
from torch import Tensor

from gradmod.hooks.per_loss.methods.bases import Aggregator, _one_per_task, _per_task


class GradDrop(Aggregator):
    """Gradient sign dropout: per coordinate, keep the positive or the negative parts of the
    task gradients, chosen at random by their sign purity. Needs the task gradients. On a
    ``modules:`` rule with ``rows: batch``, the authors' and LibMTL's form (``aggregate_batch``)."""

    name = "graddrop"

    def __init__(self, leak: list[float] | None = None):
        self.leak = None if leak is None else _per_task("graddrop", "leak", leak, 0.0, high=1.0)

    def set_tasks(self, names: list[str]) -> None:
        _one_per_task("graddrop", "leak", self.leak, len(names))

    def aggregate(self, J: Tensor, U: Tensor) -> Tensor:
        """``J``: [k, D] task gradients; ``U``: [D] uniform draws."""
        return self._drop(J, J, U, eps=0.0)

    def aggregate_batch(self, D: Tensor, signs: Tensor, U: Tensor) -> Tensor:
        """``D``: [k, B, F] the task gradients of a representation, ``signs``: [B, F] its
        signs, ``U``: [F] uniform draws. Each feature's purity from the tasks' gradients
        times the activation's sign, summed over the batch, and one choice per feature for
        every example (as the paper and LibMTL, whose 1e-7 guards the division)."""
        return self._drop(D, (D * signs).sum(1).unsqueeze(1), U, eps=1e-7)

    def _drop(self, J: Tensor, S: Tensor, U: Tensor, eps: float) -> Tensor:
        """Keep each task's part of ``J`` whose sign in ``S`` (its signed gradients, or their
        batch sums) the draw picks."""
        leak = J.new_zeros(len(J)) if self.leak is None else J.new_tensor(self.leak)
        P = 0.5 * (1.0 + S.sum(0) / (S.abs().sum(0) + eps))
        out = torch.zeros_like(J[0])
        for i in range(len(J)):
            keep = (P > U) * (S[i] > 0) + (P < U) * (S[i] < 0)
            out += (leak[i] + (1 - leak[i]) * keep) * J[i]
        return out
