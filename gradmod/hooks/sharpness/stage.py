"""The sharpness stage: the gradient at ``w + e`` instead of at ``w``, in two passes.

1. ``check_rule``: one transform per rule; ``check``: a parameter in one sharpness rule at
   most; FSDP2-sharded parameters refused. It runs the backward itself (its row of
   ``gradmod.hooks.stages``), so ``attach`` refuses a rule of a stage that cannot follow it.
2. attach: the rules' parameters, and a guard on each rule's first parameter that refuses
   a backward reaching it outside ``HookSet.backward`` (it would silently be plain); a
   ``torch.autograd.grad`` inside the loss (a gradient penalty) fills no ``.grad`` and passes.
3. backward (``HookSet.backward(loss, closure=fn)``, ``fn()`` recomputing the loss at the
   current parameters). On an optimizer step where a rule is due (``every``, ``k``):

   a. the first backward to the due rules' trainable parameters only
      (``backward(inputs=...)``; ``requires_grad`` read now, so a tensor frozen since
      attach neither moves nor gets a gradient), their ``.grad`` set aside, so that what
      earlier micro-batches accumulated there stays and this backward's gradient ``g``
      stands alone;
   b. per rule, ``e`` from ``g`` (its transform: ``sam``, ``asam``, ...; the transforms
      before it shape ``g``), the parameters copied into buffers kept from step to step,
      then moved by ``e``;
   c. the second forward and backward, which accumulates into ``.grad`` of every parameter
      as a plain backward does (a rule whose transform ``combines`` takes its own alone and
      adds what it makes of both), the normalisation layers' running statistics left as
      they were (``running_stats_frozen``): counted once per step;
   d. the parameters copied back, bitwise, also when the second pass raised.

   On a step where no rule is due: one backward, ``fn`` not called (a transform that
   ``corrects`` changes its rule's gradient of it: ``looksam``).
4. finish (``after_backward``): the optimizer step is counted; the count decides which
   steps are due and is in the stage's ``state_dict`` with the transforms' tensors.

``set_optimizer(opt)`` hands the stage the optimizer, for what reads it: ``gsam``'s rho
following the learning rate, ``wsam``'s decoupled move after ``opt.step()``.

Parameters outside every rule do not move but get the gradient at the moved point (SAM-ON:
``params: "*norm*"``). Under DDP the loop runs the first forward under ``no_sync``
(``forward_passes``: 2), so each rank moves by its own gradient.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch
from torch import Tensor, nn

from gradmod.hooks import registry as R
from gradmod.hooks.losses import summed, total
from gradmod.hooks.second_pass import Copies, accumulate, running_stats_frozen, set_aside
from gradmod.hooks.sharpness.passes import SharpRule, Taken, sharpness_rules
from gradmod.hooks.stage import Core, Loop, Stage


class SharpnessStage(Stage):
    """The sharpness rules of one ``attach`` call on ``model``."""

    name = "sharpness"
    on_sharded = "sharpness rules do not run on FSDP-sharded parameters yet; use trainer.strategy=ddp or one process"

    @classmethod
    def check_rule(cls, rule: str, kind: str, names: list[str], spec: Mapping[str, Any]) -> None:
        """One transform that moves the parameters, last, after what shapes its ascent
        (``centralize``: SAM's ``use_gc``)."""
        accepted = R.accepted_at(cls.name)
        moves = [n for n in names if n in accepted and R.entry(n).kind == cls.name]
        if len(moves) != 1 or names[-1] != moves[0]:
            shapes = [n for n in accepted if R.entry(n).kind != cls.name]
            raise ValueError(
                f"hooks.{rule}.transforms: a sharpness rule holds exactly one of "
                f"{', '.join(n for n in accepted if n not in shapes)} (how its parameters move), last, "
                f"after what shapes its ascent ({', '.join(shapes)}); got {', '.join(names)}; put the others in "
                "rules of their own"
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
        self.core = core
        self.rules = sharpness_rules(targets, dict(model.named_parameters()))
        self.step = 0  # optimizer steps finished: which steps are due
        self.inside = False  # True while the stage runs its backward passes
        self.fresh = True  # no backward yet in the optimizer step in progress
        self.optimizer: torch.optim.Optimizer | None = None
        self._opt_handle: Any = None
        self._copies = Copies()  # each moved parameter's buffer, to move it back
        # A backward that reaches a rule outside hooks.backward would silently be plain.
        self._handles = [r.params[0].register_hook(self._guard(r.name)) for r in self.rules]

    def _guard(self, rule: str) -> Callable[[Tensor], None]:
        def hook(grad: Tensor) -> None:
            if not self.inside and self.core.fills_grad():  # torch.autograd.grad in the loss: the user's
                raise RuntimeError(
                    f"hooks.{rule}: a sharpness rule needs its loss through hooks.backward(loss, "
                    "closure=fn), not loss.backward()"
                )

        return hook

    def set_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer that steps the rules' parameters: its learning rates are read at
        each step, and the transforms that act after ``optimizer.step()`` act then."""
        if self._opt_handle is not None:
            self._opt_handle.remove()
        self.optimizer = optimizer
        self._opt_handle = optimizer.register_step_post_hook(self._after_optimizer_step)

    def _after_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for r in self.rules:
            r.transform.after_step(optimizer.param_groups)

    def _lr(self, rule: SharpRule) -> float | None:
        """The learning rate the optimizer steps ``rule``'s first parameter with."""
        if self.optimizer is None:
            return None
        first = rule.params[0]
        group = next((g for g in self.optimizer.param_groups if any(q is first for q in g["params"])), None)
        return None if group is None else float(group["lr"])

    def set_up(self, loop: Loop) -> None:
        """Under DDP, the transforms that combine both passes' gradients or keep state per rank are refused."""
        local = next((r for r in self.rules if r.transform.one_process), None)
        if loop.world_size > 1 and local is not None:
            raise ValueError(
                f"hooks.{local.name}: {local.transform.name!r} combines the gradients of its two passes "
                "(or keeps state) on each rank, which DDP's averaging in between would mix; run it on one process "
                "(sam and asam run under DDP)"
            )

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
        self._check_loop()
        due = self.due()
        self.inside = True
        try:
            if due:
                self._two_passes(total(losses), lambda: summed(closure()).backward(), due)
            else:
                self._one_pass(total(losses))
        finally:
            self.inside = False
            self.fresh = False
        return True

    def _check_loop(self) -> None:
        """What a transform needs from the loop: the optimizer; no fp16 loss scale under state."""
        for r in self.rules:
            need = r.transform.needs_optimizer
            if need is not None and self.optimizer is None:
                raise ValueError(
                    f"hooks.{r.name}: {r.transform.name!r} with {need} needs the optimizer: call "
                    "hooks.set_optimizer(optimizer) once before training (gradmod's trainer does)"
                )
            if r.transform.stateful and self.core.grad_scale is not None:
                raise ValueError(
                    f"hooks.{r.name}: {r.transform.name!r} keeps gradients from step to step, which an fp16 "
                    "step that overflows (and GradScaler skips) would poison; use bf16 or fp32"
                )

    def _at(self, rule: SharpRule):
        return rule.ascent(self.step, self._lr(rule), self.fresh, self.core.grad_scale)

    def _one_pass(self, loss: Tensor) -> None:
        """A step no rule is due at: one backward; the rules that correct it take theirs alone."""
        fixing = [(r, r.trainable()) for r in self.rules if r.transform.corrects]
        params = [p for _, ps in fixing for p in ps]
        if not params:
            loss.backward()
            return
        with set_aside(params) as held:
            loss.backward()
            for r, ps in fixing:
                got = [(p, p.grad) for p in ps if p.grad is not None]
                r.transform.correct([p for p, _ in got], [g for _, g in got], self._at(r))
            accumulate(params, held)

    def _two_passes(self, loss: Tensor, again: Callable[[], None], due: list[SharpRule]) -> None:
        live = [(r, r.trainable()) for r in due]
        params = [p for _, ps in live for p in ps]
        if not params:  # every parameter of the due rules frozen since attach: nothing moves
            loss.backward()
            return
        with set_aside(params):
            loss.backward(inputs=params)
            first = [p.grad for p in params]
        taken = Taken.split(live, first)
        del first
        moved, saved = self._move(taken)
        alone = [p for t in taken if t.rule.transform.combines for p in t.params]
        with set_aside(alone) as held:  # a rule that combines takes its gradient at w + e alone
            try:
                with running_stats_frozen(self.model):
                    again()
            finally:
                if moved:
                    with torch.no_grad():
                        torch._foreach_copy_(moved, saved)
            for t in taken:
                if t.rule.transform.combines:
                    made = t.rule.transform.combine(t.params, t.grads, t.second(), self._at(t.rule))
                    for p, g in zip(t.params, made):
                        p.grad = g
            accumulate(alone, held)

    @torch.no_grad()
    def _move(self, taken: list[Taken]) -> tuple[list[Tensor], list[Tensor]]:
        """Copy the due rules' parameters, then ``w += scale * d`` (one pass per tensor), each
        rule with its own norm and rho; returns (the moved parameters, their copies)."""
        steps = [(t, *t.rule.transform.direction(t.params, t.grads, self._at(t.rule))) for t in taken]
        moved = [p for t in taken for p in t.params]
        saved = self._copies.of(moved)
        for t, d, scale in steps:
            torch._foreach_addcmul_(t.params, d, [scale] * len(t.params))
            if not t.rule.transform.combines:
                t.grads = []  # the first pass's gradients are not needed after the move
        return moved, saved

    def finish(self) -> None:
        """The optimizer step's gradient is complete (``after_backward``): count the step."""
        self.step += 1
        self.fresh = True

    def state_dict(self) -> dict[str, Any]:
        names = {p: n for n, p in self.model.named_parameters()}
        kept = {r.name: s for r in self.rules if (s := r.transform.state_dict(names))}
        return {"sharpness": {"step": self.step, **({"rules": kept} if kept else {})}}

    def load_state_dict(self, state: Mapping[str, Any], device: Any = None) -> None:
        if "sharpness" in state:
            mine = state["sharpness"]
            self.step = int(mine["step"])
            params = dict(self.model.named_parameters())
            for r in self.rules:
                r.transform.load_state_dict(mine.get("rules", {}).get(r.name, {}), params)

    def remove(self) -> None:
        self._copies = Copies()
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self._opt_handle is not None:
            self._opt_handle.remove()
            self._opt_handle = None
