"""What the Trainer asks of the hooks it is handed, as two protocols.

``Hooks``: what any hooks object answers, a ``HookSet`` or an object of one's own: the step's
backward, the work due before ``optimizer.step()``, the ``log`` statistics, and under fp16
the loss scale. ``StagedHooks``: what a ``HookSet`` answers beyond that, from its stages
(``gradmod.hooks.stage.Stage``): the stages themselves (DDP's reduction and the step's
divisor, ``gradmod.training.stage_sync``), the loop's facts (``set_up``, ``set_loss_divisor``), the forward passes
of a micro-batch (a second one through ``backward``'s closure), the step's losses after the
optimizer step, and the stage keeping each example's scores.

The Trainer asks ``isinstance(hooks, StagedHooks)`` once: an object of one's own that does not
answer all of it trains through ``Hooks`` alone, as without stages: one forward pass a
micro-batch, ``backward(losses)`` without a closure, nothing set up, no losses after the step,
no scores.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Protocol, Sequence, runtime_checkable

from torch import Tensor

from gradmod.hooks.stage import Loop, ScoreKeeper, Stage


class Hooks(Protocol):
    """What the Trainer asks of any hooks object (``hooks=``)."""

    @property
    def needs_after_backward(self) -> bool:
        """``after_backward()`` has work before each optimizer step."""

    def backward(self, losses: Any) -> None:
        """Replaces ``loss.backward()`` for one loss, or several named ones."""

    def after_backward(self) -> Any:
        """The work due before ``optimizer.step()``; a truthy answer skips the step."""

    def read_stats(self) -> dict[str, Any]:
        """The ``log`` statistics since the last read ({} when none)."""

    def set_grad_scale(self, scale: Tensor | None) -> None:
        """Under fp16: the loss scale of the next backward."""


@runtime_checkable
class StagedHooks(Protocol):
    """What the Trainer asks of hooks made of stages (a ``HookSet``), beyond ``Hooks``."""

    @property
    def stages(self) -> Sequence[Stage]:
        """One ``Stage`` per stage some rule runs at, in stage order."""

    def backward(self, losses: Any, closure: Callable[[], Any] | None = None) -> None:
        """``closure``: the losses recomputed at the current parameters, for a second pass."""

    def forward_passes(self) -> int:
        """Forward passes each micro-batch of the optimizer step in progress takes (1 or 2)."""

    @property
    def wants_step_losses(self) -> bool:
        """A stage learns from the step's batch's losses after the optimizer step."""

    def after_step(self, losses: Mapping[str, Tensor]) -> None:
        """The same batch's named losses after ``optimizer.step()``, computed without gradients."""

    def set_up(self, loop: Loop) -> None:
        """What the loop knows (ranks, examples per step, the all-reduce)."""

    def set_loss_divisor(self, divisor: float) -> None:
        """What each micro-batch's loss is divided by (a penalty is each micro-batch's own)."""

    @property
    def keeping_scores(self) -> ScoreKeeper | None:
        """The stage keeping each example's scores (told each batch's dataset indices), or None."""
