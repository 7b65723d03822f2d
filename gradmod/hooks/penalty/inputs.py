"""The inputs an ``input_grad_penalty`` rule differentiates: each selected module's first
floating-point argument, taken in a forward pre-hook of a training forward on a due step.

An input that takes no gradient is replaced by a copy that does (nothing upstream is lost:
it had no graph); one that takes one already (a generator's output, a hidden state) is kept
as it is, so the penalty's gradient flows on through it. Each forward of the module until the
next backward adds its input: the penalty is over all of them."""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor, nn


class Inputs:
    """The inputs of one module since the last take, for the rule called ``rule``."""

    def __init__(self, rule: str, module: nn.Module, where: str, due: Callable[[], bool]):
        self.rule, self.where, self._due = rule, where, due
        self.taken: list[Tensor] = []
        self.handle = module.register_forward_pre_hook(self._pre, with_kwargs=True)

    def _pre(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if not (torch.is_grad_enabled() and module.training and self._due()):
            return None
        at = next((i for i, a in enumerate(args) if isinstance(a, Tensor) and a.is_floating_point()), None)
        if at is None:
            got = ", ".join(type(a).__name__ if not isinstance(a, Tensor) else f"{a.dtype} tensor" for a in args)
            raise ValueError(
                f"hooks.{self.rule}: input_grad_penalty differentiates the loss by {self.where}'s input, which "
                f"holds no floating-point tensor (got {got or 'no positional argument'}); for token ids select a "
                "module after the embedding (its input is the hidden states)"
            )
        x = args[at]
        if not x.requires_grad:
            x = x.detach().requires_grad_()
            args = (*args[:at], x, *args[at + 1 :])
        if not any(t is x for t in self.taken):  # a tensor given twice is one input (its gradient sums both uses)
            self.taken.append(x)
        return args, kwargs

    def take(self) -> list[Tensor]:
        """The inputs since the last take, and a fresh start."""
        out, self.taken = self.taken, []
        return out

    def remove(self) -> None:
        self.handle.remove()
        self.taken = []
