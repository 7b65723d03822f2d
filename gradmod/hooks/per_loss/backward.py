"""One ``hooks.backward(losses)`` call of the per_loss stage, as its phases read it: a frozen
value handed down (the phases after the task order never reach into the stage)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class Backward:
    """``names``: the tasks, in the stage's order (a method's state is by position);
    ``losses``: theirs, in that order; ``trainable``: the parameters that train now, in model
    order; ``outputs``: id(module) -> its outputs in this backward's forward (a ``modules:``
    rule's, the frontier's); ``generator``: every random choice's; ``reduce``: the mean over
    the ranks in place (data parallelism), or None; ``grad_scale``: GradScaler's (fp16), or None;
    ``autocast``: the dtype the forward ran its matmuls in under autocast (every task gradient
    then carries its rounding, whatever its own dtype), or None."""

    names: list[str]
    losses: list[Tensor]
    trainable: list[nn.Parameter]
    outputs: Mapping[int, list[Tensor]]
    generator: torch.Generator
    reduce: Callable[[list[Tensor]], None] | None
    grad_scale: Tensor | None
    autocast: torch.dtype | None = None

    def unscaled(self, t: Tensor, power: int) -> Tensor:
        """``t`` without GradScaler's factor (the Gramian has it squared, the losses once)."""
        if self.grad_scale is None:
            return t
        return t / float(self.grad_scale) ** power
