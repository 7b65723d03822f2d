"""The fused stage: transforms applied in place to the accumulated ``.grad`` tensors after
backward, once per optimizer step, each rule's steps in config order.

1. ``check``: nothing to refuse; it runs on FSDP2-sharded ``.grad`` too.
2. attach: the rule's targets grouped per (rule, step) (``fused_transforms``); nothing is
   hooked.
3. backward: autograd's own, which accumulates ``.grad``.
4. finish (``HookSet.after_backward``): every step in config order (``run_fused``); a
   group transform may answer "skip the optimizer step".

A step of a rule is applied to all the rule's gradients at once: a group transform
(``gradmod.hooks.fused.group``) gets them all; a transform with a foreach form makes one
grouped call; ``log`` computes the rows of all the rule's tensors together; any other
runs per tensor, each tensor with its own instance (observers and stateful transforms
keep one state per tensor, as in the hook stage).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
from torch import Tensor, nn

from gradmod.hooks import registry as R
from gradmod.hooks.fused.trainability import TrainabilitySwitch
from gradmod.hooks.rules.targets import group_steps, observer_key
from gradmod.hooks.stage import Core, Stage
from gradmod.hooks.stats.grad_stats import observe_batch


@dataclass
class FusedTransform:
    """One transform of one rule over the rule's tensors (names and parameters in model order)."""

    rule: str
    steps: list[R.BuiltTransform]  # per tensor; for a group transform the same BuiltTransform every time
    names: list[str]
    params: list[nn.Parameter]
    checked: bool = field(default=False)

    @property
    def switches_trainability(self) -> bool:
        """A group transform that says it switches ``requires_grad`` off while it acts (``freeze``)."""
        first = self.steps[0]
        return first.kind == "group" and first.fn.switches_trainability

    def run(self) -> Tensor | None:
        """Apply in place; a group transform may answer a device bool "skip the step"."""
        live = [i for i, p in enumerate(self.params) if p.grad is not None]
        if not live:
            return None
        first = self.steps[0]
        grads = [self.params[i].grad for i in live]
        if first.kind == "group":
            return first.fn.apply_([self.params[i] for i in live], grads)
        if first.inplace is not None:  # one grouped foreach call (stateless forms)
            first.inplace(grads)
            return None
        if first.observer:  # the rule's rows together, as the hook stage batches them
            observe_batch([self.steps[i].fn for i in live], grads, histograms=True)
            return None
        for i, g in zip(live, grads):
            out = self.steps[i](g)
            if out is not None:
                if not self.checked:
                    self._check(self.steps[i].name, self.names[i], g, out)
                g.copy_(out)
        self.checked = True
        return None

    def _check(self, transform: str, tensor: str, grad: Tensor, out) -> None:
        """A result written into ``.grad`` must be a tensor just like it (checked on the
        first call only, so a step pays nothing for it)."""
        if (
            isinstance(out, Tensor)
            and out.shape == grad.shape
            and out.dtype == grad.dtype
            and out.device == grad.device
        ):
            return
        got = (
            f"shape {tuple(out.shape)}, dtype {out.dtype}, device {out.device}"
            if isinstance(out, Tensor)
            else type(out).__name__
        )
        raise ValueError(
            f"hooks.{self.rule}: transform {transform!r} returned {got} for {tensor!r}; the fused "
            f"stage needs shape {tuple(grad.shape)}, dtype {grad.dtype}, device {grad.device} (or None)"
        )


def fused_transforms(targets, params: dict[str, nn.Parameter]) -> list[FusedTransform]:
    """The fused-stage targets as (rule, step index) groups, in config order."""
    by_rule: dict[str, list] = {}
    for t in targets:
        if t.stage == "fused":
            by_rule.setdefault(t.rule, []).append(t)
    return [
        FusedTransform(rule, [t.steps[i] for t in group], [t.name for t in group], [params[t.name] for t in group])
        for rule, group in by_rule.items()
        for i in range(len(group[0].steps))
    ]


def run_fused(steps: list[FusedTransform], inactive: set[str] | frozenset[str] = frozenset()) -> bool:
    """Run every step but those of ``inactive`` rules (outside their window); True when a
    group transform asks to skip the optimizer step. The host reads that answer only when
    such a transform is configured to give one."""
    answers = [a for a in (s.run() for s in steps if s.rule not in inactive) if a is not None]
    if not answers:
        return False
    return bool(torch.stack(answers).any())


class FusedStage(Stage):
    name = "fused"
    on_sharded = None  # it transforms the reduced, sharded .grad

    @classmethod
    def check(cls, model: nn.Module, targets: list) -> None:
        """Each group transform sees its rule's tensors (``GroupTransform.bind``) and may refuse some."""
        params = dict(model.named_parameters())
        mine = [t for t in targets if t.stage == cls.name]
        for _, rule, step in group_steps(mine):
            step.fn.bind(rule, {t.name: params[t.name] for t in mine if t.rule == rule})

    def __init__(self, model: nn.Module, targets: list, core: Core):
        self.targets = [t for t in targets if t.stage == self.name]
        self._core = core  # its ``inactive``: the rules outside their window now
        self._steps = fused_transforms(self.targets, dict(model.named_parameters()))
        self._groups = [(key, s.fn) for key, _, s in group_steps(self.targets)]
        frozen: dict[str, list[nn.Parameter]] = {}  # freeze rules: requires_grad off while they act
        for step in self._steps:
            if step.switches_trainability:
                frozen.setdefault(step.rule, []).extend(step.params)
        self._switch = TrainabilitySwitch(model, frozen, core) if frozen else None

    @property
    def changes_trainability(self) -> bool:
        return self._switch is not None

    def finish(self) -> bool:
        return run_fused(self._steps, self._core.inactive)

    def records(self) -> list[tuple[str, Any]]:
        """Each ``log``'s accumulator, then each group transform's ``NormRecord`` (key
        ``rule/transform``: total norm before it, clip coefficient)."""
        logs = [(observer_key(t, s.fn), s.fn) for t in self.targets for s in t.steps if s.observer]
        return logs + [(key, fn.record) for key, fn in self._groups]

    def state_dict(self) -> dict[str, Any]:
        """The group transforms' state (zclip's running mean and variance), by ``rule/transform``."""
        return {"group": {key: fn.state_dict() for key, fn in self._groups}}

    def load_state_dict(self, state: Mapping[str, Any], device: Any = None) -> None:
        groups = state.get("group", {})
        for key, fn in self._groups:
            if key in groups:
                fn.load_state_dict(groups[key], device)

    def remove(self) -> None:
        self._steps.clear()
        if self._switch is not None:
            self._switch.remove()
