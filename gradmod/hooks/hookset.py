"""``HookSet``: attach the transforms the rules select, keep every handle, run the stages.

A rule (``gradmod.hooks.rules.targets``) with ``params`` transforms each selected parameter's gradient;
one with ``modules`` the gradient of the module's *output* (the articles' ``x.register_hook``
inside ``forward``). Several rules on one tensor chain in config order within a stage; the
stages act in the order of ``gradmod.hooks.stages.STAGES`` (``HookSet.chains`` lists that
order). Each is a ``gradmod.hooks.stage.Stage`` in a folder of its own (a ``ScoreKeeper`` where
it keeps each example's scores); ``HookSet`` runs them through that protocol and names none:

* ``penalty``: ``backward(loss)`` first adds a term of the loss's own gradient to the loss
  (``grad_penalty``, ``input_grad_penalty``: ``gradmod.hooks.penalty``).
* ``hook``: ``Tensor.register_hook`` on the tensor; each backward's local gradient
  before it is accumulated into ``.grad`` (and before DDP's all-reduce).
* ``per_loss``: ``backward(losses)`` with several named losses: the rule's parameters get
  its method's combination of the task gradients (``gradmod.hooks.per_loss``).
* ``per_sample``: each example's gradient (``gradmod.hooks.per_sample``); the clipped,
  noised mean is written at the start of ``after_backward()``.
* ``sharpness``: ``backward(loss, closure=fn)`` leaves in ``.grad`` the gradient at the rule's
  parameters moved to ``w + e``, by a second forward and backward (``gradmod.hooks.sharpness``).
* ``fused``: ``after_backward()`` transforms the accumulated ``.grad`` tensors, grouped
  per transform with ``torch._foreach_*`` ops, once per optimizer step; a transform
  without a foreach form runs per tensor, each with its own state.
"""

from __future__ import annotations

import weakref
from contextlib import nullcontext
from typing import Any, Callable, Mapping, Sequence, cast

import torch
from torch import Tensor, nn
from torch.utils.weak import WeakIdKeyDictionary

from gradmod.hooks import compatible, stages
from gradmod.hooks.after_backward_due import AfterBackwardDue, sentinels
from gradmod.hooks.losses import named, total
from gradmod.hooks.mesh.sharded import refuse_optimizer_in_backward, refuse_pipeline_stage, watch
from gradmod.hooks.rules import targets as selection
from gradmod.hooks.rules.targets import Target, build_targets, check_options
from gradmod.hooks.rules.timed import Timed
from gradmod.hooks.schedules import Length
from gradmod.hooks.stage import Core, Loop, ScoreKeeper, Stage
from gradmod.hooks.stats.grad_stats import take_all
from gradmod.hooks.trace.fills_grad import FillsGrad

# model -> its live HookSets, so attaching again replaces rather than doubles the hooks.
_ATTACHED: weakref.WeakKeyDictionary[nn.Module, list[HookSet]] = weakref.WeakKeyDictionary()
# hooked parameter or module -> the live HookSet holding its hooks, whatever root reached it.
_OWNERS = WeakIdKeyDictionary()


class HookSet:
    """The hooks one ``attach`` call registered. ``remove()`` (or leaving a ``with``
    block) removes every handle; ``after_backward()`` finishes the stages that act after
    backward. ``stages``: one ``Stage`` per stage some rule runs at, in stage order."""

    def __init__(
        self,
        model: nn.Module,
        targets: list[Target],
        loss_reduction: str = "mean",
        batch_dim: int | None = None,
        length: Length | None = None,
    ):
        self.targets = targets
        self._core = Core(loss_reduction, batch_dim=batch_dim, fills_grad=FillsGrad(model.parameters()))
        # The step clock, the scheduled arguments and the windows (rules that change over training).
        self.timed = Timed(targets, {t.rule: t.active for t in targets if t.active is not None}, length or Length())
        self._core.windows = frozenset(self.timed.windows)
        self._tick()
        at = {t.stage for t in targets}
        self.stages: list[Stage] = [
            stages.stage_class(name)(model, targets, self._core) for name in stages.names() if name in at
        ]
        params, modules = dict(model.named_parameters()), dict(model.named_modules())
        # Every tensor this set transforms, so another attach call cannot hook it twice.
        self._owned = [params[t.name] if t.kind == "param" else modules[t.name] for t in targets]
        # fully_shard after attach would leave the rules on parameters no longer in the model.
        self._watch = watch(model, {t.name: params[t.name] for t in targets if t.kind == "param"})
        self._keys = {t.key for t in targets}
        self._params = {t.name: params[t.name] for t in targets if t.kind == "param"}
        self._stepped_once = False
        self._due = AfterBackwardDue(model, sentinels(targets, params, self.timed))  # a forgotten after_backward()
        for obj in self._owned:
            _OWNERS[obj] = self

    @property
    def chains(self) -> list[tuple[str, list[str]]]:
        """(tensor name, transform names) in application order; module outputs as ``name:output``."""
        return selection.chains_of(self.targets)

    def describe(self) -> list[dict[str, Any]]:
        """The plan with rules, stages and arguments, for printing and saving (application order)."""
        return selection.describe(self.targets)

    def format_plan(self) -> str:
        return selection.format_plan(selection.describe(self.targets))

    def stage(self, name: str) -> Stage | None:
        """The stage called ``name`` when some rule runs at it, else None."""
        return next((s for s in self.stages if s.name == name), None)

    @property
    def keeping_scores(self) -> ScoreKeeper | None:
        """The stage keeping each example's scores (``stages.keeping_scores()``) where a rule holds ``scores``."""
        stage = self.stage(stages.keeping_scores())
        return cast(ScoreKeeper, stage) if stage is not None and stage.keeps_scores else None

    @property
    def needs_after_backward(self) -> bool:
        """Some rule runs at a stage that ``after_backward()`` finishes (per_sample, sharpness, fused:
        ``Stage.needs_after_backward``), or changes over training (its clock advances there)."""
        return bool(self.timed) or any(s.needs_after_backward for s in self.stages)

    @property
    def changes_trainability(self) -> bool:
        """Some rule switches ``requires_grad`` in training (``freeze``): DDP needs ``find_unused_parameters=True``."""
        return any(s.changes_trainability for s in self.stages)

    def backward(
        self, losses: Tensor | Mapping[str, Tensor] | Sequence[Tensor], closure: Callable[[], Any] | None = None
    ) -> None:
        """Replaces ``loss.backward()``: one scalar loss, or several named (a mapping) or ordered
        (a sequence) ones, whose gradients sum into ``.grad``. A stage that runs the backward itself
        (per_loss: its rules' parameters get the rule's combination of the task gradients, every
        other parameter the gradient of the sum) takes it over; ``closure()``: the loss again, for a second pass."""
        given: Any = losses if isinstance(losses, Tensor) else named(losses)
        self._core.through_backward = True
        try:
            for stage in self.stages:  # a penalty's term, before any backward
                given, closure = stage.penalize(given, closure)
            # A second forward at moved parameters (and back) is not a step taken without after_backward().
            with self._due.parameters_moved() if self.forward_passes() > 1 else nullcontext():
                for stage in self.stages:
                    if stage.backward(given, closure):
                        return
            total(given).backward()
        except RuntimeError as e:
            line = next((line for stage in self.stages if (line := stage.refusal(e)) is not None), None)
            if line is None:
                raise
            raise ValueError(line) from None
        finally:
            self._core.through_backward = False

    def forward_passes(self) -> int:
        """Forward passes each micro-batch of this optimizer step takes (``Stage.forward_passes``):
        2 where a stage's second runs through ``backward``'s closure; under DDP only the last
        may all-reduce."""
        return max((s.forward_passes() for s in self.stages), default=1)

    def end_epoch(self) -> None:
        """Close an epoch for the stages that count in epochs (per_loss's ``dwa``)."""
        for stage in self.stages:
            stage.end_epoch()

    @property
    def wants_step_losses(self) -> bool:
        """A stage learns from the step's batch's losses after the optimizer step (famo)."""
        return any(stage.wants_step_losses for stage in self.stages)

    def after_step(self, losses: Mapping[str, Tensor]) -> None:
        """Hand the stages that want them (``wants_step_losses``) the same batch's named
        losses after ``optimizer.step()``, computed under ``torch.no_grad()``."""
        for stage in self.stages:
            if stage.wants_step_losses:
                stage.after_step(losses)

    def after_backward(self) -> bool:
        """Finish the stages that act after backward, in their order (call before optimizer.step):
        the per_sample stage's parameters get their clipped, noised mean gradient, then the fused
        stage transforms the accumulated gradients. Returns True when the optimizer step must be
        skipped (``zclip(on_spike="skip")`` saw a spike: only then is the host read), else False."""
        self._due.done()
        if not self._stepped_once:  # optimizer-in-backward hooks registered after attach
            self._stepped_once = True
            refuse_optimizer_in_backward(self.targets, self._params, late=True)
        skip = False
        for stage in self.stages:
            skip = bool(stage.finish()) or skip
        self.timed.advance()  # the next step's scheduled values and windows, on the host
        self._tick()
        return skip

    def _tick(self) -> None:
        """The core follows the clock: the step, and the rules outside their window."""
        self._core.step, self._core.inactive = self.timed.t, frozenset(self.timed.inactive)

    @property
    def step(self) -> int:
        """The optimizer steps completed (``after_backward`` calls, or ``set_step``)."""
        return self.timed.t

    def set_step(self, t: int) -> None:
        """Set the step clock to ``t`` completed optimizer steps (a trainer's global step):
        scheduled values and windows follow."""
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise ValueError(f"set_step: t={t!r} must be an int >= 0 (optimizer steps completed)")
        if t != self.timed.t:
            self.timed.at(t)
            self._tick()

    def set_up(self, loop: Loop) -> None:
        """Hand every stage what the loop knows (``Loop``: ranks, step examples, Poisson sampling, the all-reduce)."""
        for stage in self.stages:
            stage.set_up(loop)

    def set_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Hand every stage the optimizer that steps the rules' parameters."""
        for stage in self.stages:
            stage.set_optimizer(optimizer)

    @property
    def grad_scale(self) -> Tensor | None:
        """GradScaler's scale of the backward in progress (fp16), or None."""
        return self._core.grad_scale

    def set_grad_scale(self, scale: Tensor | None) -> None:
        """Under fp16, the loss scale of the next backward (a device tensor): hook-stage
        transforms then see the unscaled gradient, as in fp32."""
        self._core.grad_scale = scale

    def set_loss_divisor(self, divisor: float) -> None:
        """What the loop divides each micro-batch's loss by: a penalty is the micro-batch's own."""
        if not divisor > 0:
            raise ValueError(f"set_loss_divisor: divisor={divisor!r} must be > 0")
        self._core.loss_divisor = float(divisor)

    def observers(self) -> list[tuple[str, Any]]:
        """(statistics key, accumulator) of every stage, in stage order: each ``log``
        transform attached (key ``tensor`` or ``tensor/label``), every group transform's
        ``NormRecord`` (key ``rule/transform``: total norm before it, clip coefficient),
        the per_sample and per_loss rules' records."""
        return [record for stage in self.stages for record in stage.records()]

    def read_stats(self) -> dict[str, dict[str, Any]]:
        """Every ``log`` accumulator's buffer (and histogram, if one was taken), read
        with a single host sync."""
        observers = self.observers()
        timed = self.timed.stats()  # the scheduled values and windows of the last step
        pending = []
        for (key, obs), (calls, acc) in zip(observers, take_all([obs for _, obs in observers])):
            if acc is not None:
                pending.append((key, obs, calls, acc, obs.pre is not None))
        if not pending:
            return timed
        device = pending[0][3].device
        flat = torch.cat([acc.to(device) for _, _, _, acc, _ in pending]).tolist()
        out, i = {}, 0
        for key, obs, calls, acc, paired in pending:
            out[key] = obs.summarize(calls, flat[i : i + len(acc)], paired)
            i += len(acc)
        return {**out, **timed}

    def state_dict(self) -> dict[str, Any]:
        """What the hooks carry from step to step (the ``log`` buffers in progress, the stages' own
        state such as zclip's running mean and variance), for checkpoints: a resume is bitwise."""
        state: dict[str, Any] = {
            "log_windows": {key: obs.state_dict() for key, obs in self.observers()},  # the key checkpoints hold
            "clock": self.timed.clock.state_dict(),
        }
        for stage in self.stages:
            state.update(stage.state_dict())
        return state

    def load_state_dict(self, state: Mapping[str, Any], device: torch.device | None = None) -> None:
        """Restore ``state_dict()``'s buffers; ``device``: where this run's gradients are.
        Windows of tensors this HookSet does not observe are ignored."""
        if "clock" in state:  # first: the transforms' values at that step, then the stages' state
            self.timed.clock.load_state_dict(state["clock"])
            self.timed.at(self.timed.clock.t)
            self._tick()
        buffers = state.get("log_windows", {})
        for key, obs in self.observers():
            if key in buffers:
                obs.load_state_dict(buffers[key], device)
        for stage in self.stages:
            stage.load_state_dict(state, device)

    def set_histograms(self, on: bool) -> None:
        """Bin the gradients of the next calls on the device (for the step before a read)."""
        for _, obs in self.observers():
            obs.histogram = on

    @property
    def replaced(self) -> set[str]:
        """Parameters whose chain replaced the gradient since the last take."""
        return {name for stage in self.stages for name in stage.replaced()}

    def take_raw_parts(self) -> tuple[list[tuple[str, Tensor]], list[tuple[str, Tensor]], set[str]]:
        """What the hooks kept since the last call, and a fresh start: (tensor name, raw
        gradient to count) for chains that replaced a parameter's gradient, (module
        output, count) already counted, and the parameters whose raw gradient is not in
        their ``.grad``. ``NonFiniteGuard`` counts the tensors together with the rest."""
        raw: list[tuple[str, Tensor]] = []
        counted: list[tuple[str, Tensor]] = []
        replaced: set[str] = set()
        for stage in self.stages:
            r, c, n = stage.take_raw_parts()
            raw, counted, replaced = raw + r, counted + c, replaced | n
        return raw, counted, replaced

    def __len__(self) -> int:
        """The tensors this set transforms (0 once removed): any rule makes it true."""
        return len(self._keys)

    def remove(self) -> None:
        self._watch.remove()
        self._due.remove()
        for stage in self.stages:
            stage.remove()
        self._keys = set()
        for obj in self._owned:  # free the tensors for another attach call
            if _OWNERS.get(obj) is self:
                del _OWNERS[obj]
        self._owned = []

    def __enter__(self) -> HookSet:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def attach(
    model: nn.Module,
    rules: Mapping[str, Mapping[str, Any]] | None,
    stage: str = stages.DEFAULT,
    replace: bool = True,
    loss_reduction: str = "mean",
    batch_dim: int | None = None,
    total_steps: int | None = None,
    steps_per_epoch: int | None = None,
) -> HookSet:
    """Attach ``rules`` to ``model`` and return the ``HookSet`` holding every handle.

    ``stage`` is the default for rules that do not set one (a rule with a group
    transform runs fused). Attaching again to the same model first removes the hooks of
    the previous calls, so hooks never double; ``replace=False`` keeps them and adds a
    second HookSet on other tensors (several callbacks on one model). Tensors that carry
    a live HookSet that is not replaced (kept, or attached through another module such as
    a wrapper) are refused: remove that one first.
    ``loss_reduction``: how the loss combines the examples (``mean`` or ``sum``), so the
    per_sample stage knows each example's gradient; ``batch_dim``: the dimension of the
    model's inputs that holds the examples (default 0, or 1 for a model with
    ``batch_first = False``). ``total_steps``, ``steps_per_epoch``: the run's length in
    optimizer steps, for schedules and windows given in ``dur`` or ``ep`` (refused in one
    line without them).
    """
    check_options(stage, loss_reduction, batch_dim, total_steps, steps_per_epoch)
    length = Length(steps_per_epoch=steps_per_epoch, total_steps=total_steps)
    targets = build_targets(model, rules, stage, length)  # validate everything before touching the model
    at = {t.stage for t in targets}
    for name in stages.names():
        if name in at:
            stages.stage_class(name).check(model, targets)
    compatible.check(targets)  # what the stages combine with, from their facts
    params = dict(model.named_parameters())
    refuse_optimizer_in_backward(targets, params)
    refuse_pipeline_stage(model)
    previous = [h for h in _ATTACHED.get(model, []) if h._owned]  # the live ones
    replaced = previous if replace else []
    _refuse_overlap(model, targets, replaced)
    for old in replaced:
        old.remove()
    hooks = HookSet(model, targets, loss_reduction, batch_dim, length)
    _ATTACHED[model] = [h for h in previous if h not in replaced] + [hooks]
    return hooks


def _refuse_overlap(model: nn.Module, targets: list[Target], replaced: list[HookSet]) -> None:
    """A one-line error naming the tensors another live HookSet already transforms."""
    params, modules = dict(model.named_parameters()), dict(model.named_modules())
    taken = []
    for t in targets:
        owner = _OWNERS.get(params[t.name] if t.kind == "param" else modules[t.name])
        if owner is not None and owner not in replaced and t.key not in taken:
            taken.append(t.key)
    if taken:
        shown = ", ".join(taken[:5]) + (f" and {len(taken) - 5} more" if len(taken) > 5 else "")
        raise ValueError(
            f"attach: {shown} already carry hooks from another attach call (kept with replace=False, "
            "or through another module); call remove() on that HookSet first, or select other tensors"
        )
