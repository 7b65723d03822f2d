"""The sharpness stage: the gradient at ``w + e`` instead of at ``w``, in two passes.

1. ``check_rule``: one transform per rule; ``check``: a parameter in one sharpness rule at
   most; FSDP2-sharded parameters refused. It runs the backward itself (its row of
   ``gradmod.hooks.stages``), so ``attach`` refuses a rule of a stage that cannot follow it.
2. attach: the rules' parameters, and a guard on each rule's first parameter that refuses
   a backward reaching it outside ``HookSet.backward`` (it would silently be plain).
3. backward (``HookSet.backward(loss, closure=fn)``, ``fn()`` recomputing the loss at the
   current parameters). On an optimizer step where a rule is due (``every``):

   a. the first backward to the due rules' parameters only (``backward(inputs=...)``),
      their ``.grad`` set aside, so that what earlier micro-batches accumulated there stays
      and this backward's gradient ``g`` stands alone;
   b. per rule, ``e`` from ``g`` (its transform: ``sam``, ``asam``), the parameters copied
      into buffers kept from step to step, then moved by ``e``;
   c. the second forward and backward, which accumulates into ``.grad`` of every parameter
      as a plain backward does, the normalisation layers' running statistics left as they
      were (``running_stats_frozen``);
   d. the parameters copied back, bitwise, also when the second pass raised.

   On a step where no rule is due: a plain backward, ``fn`` not called.
4. finish (``after_backward``): the optimizer step is counted; the count decides which
   steps are due and is the stage's ``state_dict``.

Parameters outside every rule do not move but get the gradient at the moved point (SAM-ON:
``params: "*norm*"``). Under DDP the loop runs the first forward under ``no_sync``
(``forward_passes``: 2), so each rank moves by its own gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
from torch import Tensor, nn
from torch.utils.weak import WeakIdKeyDictionary

from gradmod.hooks import registry as R
from gradmod.hooks.losses import named, total
from gradmod.hooks.sharpness.batchnorm import running_stats_frozen
from gradmod.hooks.sharpness.perturb import Perturbation
from gradmod.hooks.stage import Core, Stage


@dataclass
class SharpRule:
    """One sharpness rule: its transform and the parameters it moves."""

    name: str
    transform: Perturbation
    params: list[nn.Parameter]


def sharpness_rules(targets: list[Any], params: Mapping[str, nn.Parameter]) -> list[SharpRule]:
    """The sharpness rules among ``targets`` (``gradmod.hooks.rules.Target``), in config order."""
    out: dict[str, SharpRule] = {}
    for t in targets:
        if t.stage == "sharpness":
            rule = out.setdefault(t.rule, SharpRule(t.rule, t.steps[0].fn, []))
            rule.params.append(params[t.name])
    return list(out.values())


def _with_grads(rules: list[SharpRule], grads: list[Tensor | None]):
    """(rule, its parameters with a first-pass gradient, those gradients), for each rule with any."""
    i = 0
    for r in rules:
        pairs = [(p, g) for p, g in zip(r.params, grads[i : i + len(r.params)]) if g is not None]
        i += len(r.params)
        if pairs:
            yield r, [p for p, _ in pairs], [g for _, g in pairs]


class SharpnessStage(Stage):
    """The sharpness rules of one ``attach`` call on ``model``."""

    name = "sharpness"
    on_sharded = "sharpness rules do not run on FSDP-sharded parameters yet; use trainer.strategy=ddp or one process"

    @classmethod
    def check_rule(cls, rule: str, kind: str, names: list[str], spec: Mapping[str, Any]) -> None:
        """One transform: how the rule's parameters move."""
        if len(names) != 1:
            raise ValueError(
                f"hooks.{rule}.transforms: a sharpness rule holds exactly one of {', '.join(R.accepted_at(cls.name))} "
                f"(how its parameters move), got {', '.join(names)}; put the others in rules of their own"
            )

    @classmethod
    def check(cls, model: nn.Module, targets: list) -> None:
        """A parameter moves once per step."""
        super().check(model, targets)
        sharp: dict[str, str] = {}
        for t in targets:
            if t.stage == "sharpness":
                if t.name in sharp:
                    raise ValueError(
                        f"hooks.{t.rule}: {t.name!r} is also in sharpness rule {sharp[t.name]!r}; "
                        "each parameter moves once: select it in one"
                    )
                sharp[t.name] = t.rule

    def __init__(self, model: nn.Module, targets: list, core: Core):
        self.model = model
        self.rules = sharpness_rules(targets, dict(model.named_parameters()))
        self.step = 0  # optimizer steps finished: which steps are due
        self.inside = False  # True while the stage runs its backward passes
        self._saved = WeakIdKeyDictionary()  # parameter -> the buffer it is copied into before it moves
        # A backward that reaches a rule outside hooks.backward would silently be plain.
        self._handles = [r.params[0].register_hook(self._guard(r.name)) for r in self.rules]

    def _guard(self, rule: str) -> Callable[[Tensor], None]:
        def hook(grad: Tensor) -> None:
            if not self.inside:
                raise RuntimeError(
                    f"hooks.{rule}: a sharpness rule needs its loss through hooks.backward(loss, "
                    "closure=fn), not loss.backward()"
                )

        return hook

    def due(self) -> list[SharpRule]:
        """The rules that take two passes on the optimizer step in progress."""
        return [r for r in self.rules if r.transform.due(self.step)]

    def forward_passes(self) -> int:
        """2 on an optimizer step where a rule is due (the closure's forward), else 1."""
        return 2 if self.due() else 1

    def backward(self, losses: Tensor | Mapping[str, Tensor], closure: Callable[[], Any] | None = None) -> bool:
        """The first backward of ``losses`` (summed) and, where a rule is due, the second
        pass: ``closure()`` recomputes the losses at the moved parameters, this stage runs
        their backward."""
        if not callable(closure):
            raise ValueError(
                f"hooks.{self.rules[0].name}: a sharpness rule needs a second forward at the moved "
                "parameters: call hooks.backward(loss, closure=fn), fn() returning the loss recomputed "
                "at the current parameters"
            )
        due = self.due()
        self.inside = True
        try:
            if not due:
                total(losses).backward()
            else:
                self._two_passes(total(losses), lambda: _summed(closure()).backward(), due)
        finally:
            self.inside = False
        return True

    def _two_passes(self, loss: Tensor, again: Callable[[], None], due: list[SharpRule]) -> None:
        params = [p for r in due for p in r.params]
        held = [p.grad for p in params]
        for p in params:
            p.grad = None
        try:
            loss.backward(inputs=params)
            first = [p.grad for p in params]
        finally:
            for p, g in zip(params, held):
                p.grad = g
        moved, saved = self._move(due, first)  # the first pass's gradients are gone after it
        del first
        try:
            with running_stats_frozen(self.model):
                again()
        finally:
            if moved:
                with torch.no_grad():
                    torch._foreach_copy_(moved, saved)

    @torch.no_grad()
    def _move(self, due: list[SharpRule], first: list[Tensor | None]) -> tuple[list[Tensor], list[Tensor]]:
        """Copy the due rules' parameters, then ``w += scale * d`` (one pass per tensor), each
        rule with its own norm and rho; returns (the moved parameters, their copies)."""
        steps = [(ps, *r.transform.direction(ps, gs)) for r, ps, gs in _with_grads(due, first)]
        moved = [p for ps, _, _ in steps for p in ps]
        saved = self._copies(moved)
        for ps, d, scale in steps:
            torch._foreach_addcmul_(ps, d, [scale] * len(ps))
        return moved, saved

    def _copies(self, params: list[Tensor]) -> list[Tensor]:
        """``params`` copied into buffers kept from step to step: a fresh copy each step would
        cost its allocation and page faults, as much again as the copy itself."""
        out = []
        for p in params:
            buf = self._saved.get(p)
            if buf is None or buf.shape != p.shape or buf.dtype != p.dtype or buf.device != p.device:
                buf = self._saved[p] = torch.empty_like(p)
            out.append(buf)
        if out:
            torch._foreach_copy_(out, [p.detach() for p in params])
        return out

    def finish(self) -> None:
        """The optimizer step's gradient is complete (``after_backward``): count the step."""
        self.step += 1

    def state_dict(self) -> dict[str, Any]:
        return {"sharpness": {"step": self.step}}

    def load_state_dict(self, state: Mapping[str, Any], device: Any = None) -> None:
        if "sharpness" in state:
            self.step = int(state["sharpness"]["step"])

    def remove(self) -> None:
        self._saved = WeakIdKeyDictionary()
        for h in self._handles:
            h.remove()
        self._handles.clear()


def _summed(losses: Any) -> Tensor:
    """What the closure returned: one scalar loss, or the sum of a mapping's or a sequence's."""
    return total(losses if isinstance(losses, Tensor) else named(losses))
