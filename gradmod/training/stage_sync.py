"""The Trainer's side of the hook stages: what each needs from the loop, under DDP above all.

A stage that runs its own backward passes (per_loss) or knows its result only after the
whole backward (per_sample: flat clipping's factors) cannot let DDP's bucketed all-reduce
run during backward (``Stage.ddp_may_reduce``): every backward then runs under
``no_sync``, the stage reduces what it needs through the loop's ``all_reduce_sum``
(``Stage.set_up``), and the parameters it leaves local keep DDP's meaning, the mean over
ranks of their local gradients, in one all-reduce of their own before
``HookSet.after_backward`` (``Stage.manual_mean``). A stage that divides the step's
gradient itself (``Stage.divides_step``: per_sample, by the step's examples) gets each
micro-batch's loss undivided. Under DP-SGD with Poisson sampling the divisor is the
expected batch size of the step, not the number of examples drawn (which would leak it).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from gradmod.hooks.stage import Loop
from gradmod.training.distributed.strategy import Dist
from gradmod.training.loop_hooks import StagedHooks


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


class StageSync:
    """A ``HookSet``'s stages, set up for one Trainer: ``ddp_may_reduce`` (False: every
    backward under ``no_sync``), ``divides_step`` (True: micro-batch losses undivided),
    ``before_finish()`` (the manual means, before ``after_backward``). ``hooks``: None for no
    hooks, or hooks without stages (``gradmod.training.loop_hooks``)."""

    def __init__(self, hooks: StagedHooks | None, dist_: Dist, *, poisson: bool, batch_size: int, accumulate: int):
        self.stages = list(hooks.stages) if hooks is not None else []
        self.dist = dist_
        self.ddp_may_reduce = all(s.ddp_may_reduce for s in self.stages)
        self.divides_step = any(s.divides_step for s in self.stages)
        if hooks is not None and self.stages:
            world = dist_.world_size
            hooks.set_up(
                Loop(
                    world_size=world,
                    is_main=dist_.is_main,
                    step_examples=batch_size * accumulate,
                    poisson=poisson,
                    all_reduce_sum=all_reduce_sum if world > 1 else None,
                )
            )

    def before_finish(self) -> None:
        """DDP: the mean over ranks of the gradients the stages left local."""
        if self.dist.world_size == 1:
            return
        for stage in self.stages:
            if not stage.ddp_may_reduce:
                mean_grads_over_ranks(stage.manual_mean(), self.dist.world_size)

    def end_epoch(self) -> None:
        """Stages that count in epochs close one."""
        for stage in self.stages:
            stage.end_epoch()
