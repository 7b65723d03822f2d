"""The Trainer's side of the per_sample stage (DP-SGD): the divisor, and DDP.

Each backward adds the clipped per-example gradients of its micro-batch to the step's sums;
``HookSet.after_backward`` adds the noise once and divides. The loss of a micro-batch is
therefore not divided by the number of micro-batches (each example's gradient is its own),
and under Poisson sampling the divisor is the expected batch size of the step, not the
number of examples drawn (which would leak it).

Under DDP, flat clipping knows its factors only after the whole backward, so DDP's bucketed
all-reduce must not run: every backward runs under ``no_sync``, and the stage's ``reduce``
sums the ranks' clipped sums in one all-reduce after rank 0 alone added the noise (one draw
of ``N(0, (sigma C)^2)``), then the stage divides by the global (expected) batch size:
``(sum over ranks and examples of clip(g_i) + noise) / B_global``. Parameters outside every
``per_sample_clip`` rule keep DDP's meaning (the mean over ranks of their local gradients),
with one all-reduce of their own before the stage.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gradmod.training.distributed import Dist


def all_reduce_sum(tensors: list[Tensor], divide: float = 1.0) -> None:
    """Sum ``tensors`` over the ranks, in place, with one all-reduce (then divide)."""
    if not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat)
    if divide != 1.0:
        flat.div_(divide)
    for t, part in zip(tensors, flat.split([t.numel() for t in tensors])):
        t.copy_(part.view_as(t))


def mean_grads_over_ranks(params: list, world: int) -> None:
    """Each parameter's ``.grad`` replaced by its mean over the ranks, with one all-reduce; a
    rank that has none (its micro-batches were all empty) counts zeros."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    all_reduce_sum([p.grad for p in params], float(world))


class PerSampleSetup:
    """Sets up ``hooks.per_sample`` for one Trainer: the divisor (``poisson``: the expected
    global batch ``batch_size * accumulate * world``; else the examples of the step, times
    the ranks), noise on rank 0 only, the all-reduce of the clipped sums."""

    def __init__(self, model: nn.Module, hooks, dist_: Dist, *, poisson: bool, batch_size: int, accumulate: int):
        self.stage, self.dist = hooks.per_sample, dist_
        world = dist_.world_size
        clipped = {id(p) for r in self.stage.rules if r.clip is not None for p in r.params}
        self.plain = [p for p in model.parameters() if p.requires_grad and id(p) not in clipped]
        # Poisson: the divisor is already global; shuffled: every rank counts the same examples.
        divide = 1.0 if poisson else float(world)
        hooks.set_per_sample(
            expected_batch_size=float(batch_size * accumulate * world) if poisson else None,
            reduce=(lambda sums: all_reduce_sum(sums, divide)) if world > 1 else None,
            draws_noise=dist_.is_main,
        )

    def before_stage(self) -> None:
        """DDP: the mean over ranks of the parameters the stage does not clip (DDP's own
        all-reduce was skipped); a rank whose micro-batches were all empty counts zeros."""
        if self.dist.world_size > 1:
            mean_grads_over_ranks(self.plain, self.dist.world_size)
