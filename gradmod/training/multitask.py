"""The Trainer's side of the per_loss stage: DDP over the global batch.

The stage runs backward passes of its own (the task gradients, then one weighted backward),
which DDP's bucketed all-reduce cannot follow, so under DDP every backward runs under
``no_sync`` and the stage reduces what the global batch's update needs through its
``reduce`` (a mean over the ranks, in place): per step, for a ``params`` rule the k task
gradients of its parameters (k x D floats), for a ``modules`` rule the k x k Gramian of the
output's task gradients, for a loss weighting the k loss values. The update of a ``params``
rule with a gradient method is then the global one on every rank; every other parameter
(the heads, a weighting's parameters, what a ``modules`` rule's aggregate flows into) keeps
DDP's meaning, the mean over ranks of the local gradients, in one all-reduce of its own
before the fused stage (D_rest floats). On one process nothing is reduced.
"""

from __future__ import annotations

from torch import nn

from gradmod.training.distributed import Dist
from gradmod.training.dpsgd import all_reduce_sum, mean_grads_over_ranks


class PerLossSetup:
    """Sets up ``hooks.per_loss`` for one Trainer: the stage's ``reduce`` under DDP, the
    all-reduce of the parameters whose gradient is local, the end of each epoch."""

    def __init__(self, model: nn.Module, hooks, dist_: Dist):
        self.hooks, self.dist = hooks, dist_
        stage = hooks.per_loss
        world = dist_.world_size
        # A gradient method's params rule: its update is formed from the reduced task gradients.
        whole = {id(p) for r in stage.rules if r.method.kind != "losses" for p in r.params}
        self.local = [p for p in model.parameters() if p.requires_grad and id(p) not in whole]
        if world > 1:
            stage.reduce = lambda tensors: all_reduce_sum(tensors, float(world))

    def before_stage(self) -> None:
        """DDP: the mean over ranks of the gradients the stage left local."""
        if self.dist.world_size > 1:
            mean_grads_over_ranks(self.local, self.dist.world_size)

    def end_epoch(self) -> None:
        """Methods that count in epochs (``dwa``) close one."""
        self.hooks.end_epoch()
