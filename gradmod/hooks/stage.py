"""The ``Stage`` protocol: what every stage does, so that ``HookSet`` and a loop run any of them.

A stage is one moment of a gradient's life where a rule's transforms act (the table of
facts: ``gradmod.hooks.stages``). Each lives in its own folder (``hooks/hook/``,
``hooks/per_loss/``, ``hooks/per_sample/``, ``hooks/sharpness/``, ``hooks/fused/``) and
reads, in its ``stage.py``, as its phases:

1. ``check_rule(rule, kind, names, spec)``: a rule's own shape at this stage (how many
   transforms, keys of its own), as the rule is read; ``check(model, targets)``: refuse in
   one line what it cannot do, before anything is attached. What it combines with are facts
   in its row of the table, which ``gradmod.hooks.compatible`` checks once for all stages;
2. ``__init__(model, targets, core)``: attach (hooks on tensors or modules);
3. ``penalize(losses, closure)``: add a term to the loss (a penalty stage), then
   ``backward(losses, closure)``: run the backward itself, or leave it to ``HookSet``
   (``forward_passes``: whether the closure's second forward runs this step);
4. ``finish()``: in ``HookSet.after_backward``, in stage order, before ``optimizer.step()``;
5. ``records()``, ``take_raw_parts()`` (for the non-finite count), ``state_dict()``,
   ``load_state_dict()``, ``end_epoch()``, ``remove()``.

Under DDP, a loop asks each stage whether DDP's own all-reduce may run during its backward
(``ddp_may_reduce``), which gradients it then averages over the ranks itself before
``after_backward`` (``manual_mean``), whether it divides the step's gradient itself
(``divides_step``), and hands it the facts only the loop knows (``set_up(Loop)``).

``Core`` is what the stages of one ``HookSet`` share: the optimizer-step clock, the rules'
windows, the loss scale of the backward in progress, how the loss treats the examples. What
one stage keeps (the hook stage's raw-gradient ledger, say) lives in its own room.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Mapping, Protocol

from torch import Tensor, nn

from gradmod.hooks import stages
from gradmod.hooks.mesh.sharded import refuse_sharded

# Sums tensors over the ranks in place, then divides by the number given (1.0: the sum).
AllReduceSum = Callable[[list[Tensor], float], None]


@dataclass
class Core:
    """What the stages of one ``HookSet`` share.

    ``grad_scale``: GradScaler's scale of the backward in progress (fp16), or None; ``loss_reduction``: how the loss
    combines the examples (``mean`` or ``sum``); ``step``: optimizer steps finished, one
    more at each ``HookSet.after_backward()`` (the clock a schedule reads); ``windows``: the
    rules with an ``active`` window, ``inactive``: those outside it now (they do nothing);
    ``batch_dim``: the dimension of the model's inputs that holds the examples (None: 0, or
    1 for a model with ``batch_first = False``); ``through_backward``: ``HookSet.backward`` is
    running; ``loss_divisor``: what a loop divides each micro-batch's loss by
    (``HookSet.set_loss_divisor``); ``fills_grad()``: whether the backward in progress fills
    the model's ``.grad`` (the gradient that trains it, on which rules act) rather than
    returning a gradient a loss takes of itself (``torch.autograd.grad``), asked in hooks
    (``gradmod.hooks.trace.fills_grad``)."""

    loss_reduction: str = "mean"
    grad_scale: Tensor | None = None
    step: int = 0
    windows: frozenset[str] = frozenset()
    inactive: frozenset[str] = frozenset()
    batch_dim: int | None = None
    fills_grad: Callable[[], bool] = lambda: True
    through_backward: bool = False  # HookSet.backward is running (a guard tells it from loss.backward())
    loss_divisor: float = 1.0  # the loop divides each micro-batch's loss by this (their number in a step)


@dataclass(frozen=True)
class Loop:
    """What a training loop knows and a stage may need (``Stage.set_up``).

    ``world_size``: the ranks; ``is_main``: this rank draws what one rank draws for all
    (noise); ``step_examples``: examples per rank and optimizer step (batch size times
    micro-batches), None where unknown; ``poisson``: each step's batch is a Poisson sample
    (its expected size, not the drawn one, divides); ``all_reduce_sum``: sums tensors over
    the ranks in place, then divides (None on one process)."""

    world_size: int = 1
    is_main: bool = True
    step_examples: int | None = None
    poisson: bool = False
    all_reduce_sum: AllReduceSum | None = None


class ScoreKeeper(Protocol):
    """A stage keeping each example's scores (its row's ``scores``, a rule holding ``scores``)."""

    def see_batch(self, index: Tensor, target: Tensor) -> None:
        """The dataset indices and labels of the examples of the next training forward."""

    def take_scores(self) -> dict[str, Tensor]:
        """The rows kept since the last take, on the host, by column
        (``gradmod.hooks.score_columns.KEPT``), and a fresh start."""


class Stage(abc.ABC):
    """One stage of one ``attach`` call, built only where some rule runs at it.

    The class facts (``accepts``, ``implied_by``, ``default``, ``modules``, ``sees``,
    ``needs_after_backward``) come from the stage's row in ``gradmod.hooks.stages``, so
    that the command line reads them without torch."""

    name: ClassVar[str]
    accepts: ClassVar[tuple[str, ...]]
    implied_by: ClassVar[str | None]
    default: ClassVar[bool]
    modules: ClassVar[bool]
    sees: ClassVar[str]
    needs_after_backward: ClassVar[bool]
    sees_each_pass: ClassVar[bool]
    # Under DDP: False when this stage's backward must run under no_sync (it reduces itself).
    ddp_may_reduce: ClassVar[bool] = True
    # True: the stage divides the step's gradient itself, so a loop does not divide each
    # micro-batch's loss by their number (a stage may decide per instance).
    divides_step: bool = False
    # Its rules on FSDP2-sharded parameters: None runs them, else what to do instead.
    on_sharded: ClassVar[str | None] = (
        "it is not supported for FSDP2-sharded models; use stage: fused or trainer.strategy=ddp"
    )

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "name" in cls.__dict__:
            row = stages.get(cls.name)
            cls.accepts, cls.implied_by, cls.default = row.accepts, row.implied_by, row.default
            cls.modules, cls.sees, cls.needs_after_backward = row.modules, row.sees, row.needs_after_backward
            cls.sees_each_pass = row.sees_each_pass

    @classmethod
    def check_rule(cls, rule: str, kind: str, names: list[str], spec: Mapping[str, Any]) -> None:
        """Refuse in one line a rule this stage cannot run as written (``kind``: ``param`` or
        ``module``; ``names``: its transforms; ``spec``: the rule as given)."""
        return None  # most stages run any rule their transforms' kinds allow

    # Under an optimizer stepped inside backward: what of this stage still works, for messages.
    in_backward_instead: ClassVar[str] = ""

    @classmethod
    def after_backward(cls, target: Any) -> bool:
        """Whether this stage writes ``target``'s gradient after autograd accumulated it (an
        optimizer stepped inside backward would step before it), not as it arrives."""
        return not cls.sees_each_pass

    @classmethod
    def several_passes(cls, targets: list) -> tuple[Any, str] | None:
        """This stage's first rule whose backward runs one pass per task, and how (for
        messages), or None: a hook on a module's output would see each pass."""
        return None

    @classmethod
    def check(cls, model: nn.Module, targets: list) -> None:
        """Refuse in one line what this stage cannot do with ``targets`` (every rule's)."""
        if cls.on_sharded is not None:
            refuse_sharded(cls.name, cls.on_sharded, targets, dict(model.named_parameters()))

    @abc.abstractmethod
    def __init__(self, model: nn.Module, targets: list, core: Core):
        """Attach this stage's rules (``targets``: every rule's, in config order)."""

    def penalize(self, losses: Any, closure: Callable[[], Any] | None) -> tuple[Any, Callable[[], Any] | None]:
        """The losses with this stage's terms added, and the closure whose losses gain theirs
        (the penalty stage); most stages hand both back as they are."""
        return losses, closure

    def refusal(self, error: RuntimeError) -> str | None:
        """The one line for an error torch raised in the step's backward that this stage's work
        caused and the user can change (an op with no double backward), or None."""
        return None

    def double_backward(self) -> str | None:
        """The first rule whose work differentiates the model's backward again (a penalty's
        double backward: no compiled model can), or None."""
        return None

    def backward(self, losses: Tensor | Mapping[str, Tensor], closure: Callable[[], Any] | None = None) -> bool:
        """Run the step's backward of ``losses`` (one scalar, or several by name) itself and
        answer True, or answer False and leave it to ``HookSet`` (the gradient of the sum)."""
        return False

    def finish(self) -> Tensor | bool | None:
        """The work due before ``optimizer.step()``; a truthy answer (a device bool may be
        one): skip the step."""
        return None

    def records(self) -> list[tuple[str, Any]]:
        """(statistics key, observer) for what this stage reads out at log points."""
        return []

    def state_dict(self) -> dict[str, Any]:
        """Entries this stage adds to ``HookSet.state_dict()`` (its own top-level keys)."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any], device: Any = None) -> None:  # noqa: B027
        """Restore from the whole ``HookSet.state_dict()``; keys it does not hold are ignored."""

    def end_epoch(self) -> None:  # noqa: B027  (only epoch-counting methods act)
        """An epoch ended."""

    @property
    def wants_step_losses(self) -> bool:
        """Whether ``after_step`` wants the step's batch's losses after ``optimizer.step()``
        (a loop then computes them in a forward without gradients)."""
        return False

    def after_step(self, losses: Mapping[str, Tensor]) -> None:  # noqa: B027  (famo's same-batch update)
        """The same batch's named losses after the optimizer step, computed without gradients."""

    def set_up(self, loop: Loop) -> None:  # noqa: B027  (most stages need no loop facts)
        """What the loop knows (ranks, batch size, the all-reduce)."""

    def set_optimizer(self, optimizer: Any) -> None:  # noqa: B027  (a stage that reads the learning rate acts)
        """The optimizer that steps the rules' parameters (gsam reads its learning rate)."""

    @property
    def keeps_scores(self) -> bool:
        """A rule of this stage keeps each example's scores: the stage is a ``ScoreKeeper``
        (only where its row of the table says ``scores``)."""
        return False

    @property
    def changes_trainability(self) -> bool:
        """This stage switches ``requires_grad`` during training (``freeze``): under DDP the
        wrapper must find the parameters a backward does not reach."""
        return False

    def forward_passes(self) -> int:
        """Forward passes each micro-batch of the optimizer step in progress takes: 1, or 2
        for a stage that runs a second one through ``HookSet.backward``'s closure, at moved
        parameters (sharpness). Under DDP only the last may all-reduce."""
        return 1

    def replaced(self) -> set[str]:
        """Parameters whose raw gradient a transform replaced since the last take (it is
        not in their ``.grad``: the non-finite count reads it from ``take_raw_parts``)."""
        return set()

    def take_raw_parts(self) -> tuple[list[tuple[str, Tensor]], list[tuple[str, Tensor]], set[str]]:
        """What this stage kept for the non-finite count since the last call, and a fresh
        start: (parameter, raw gradient to count), (module output, count already taken),
        the parameters whose raw gradient is not in their ``.grad``."""
        return [], [], set()

    def manual_mean(self) -> list[nn.Parameter]:
        """Under DDP with ``ddp_may_reduce`` False: the parameters whose ``.grad`` the loop
        averages over the ranks before ``after_backward`` (the stage reduces the rest)."""
        return []

    @abc.abstractmethod
    def remove(self) -> None:
        """Remove every handle; the stage does nothing more."""
