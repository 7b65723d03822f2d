"""The penalty stage: the loss gains ``weight * ||g||^power`` from its own gradient ``g``.

1. ``check_rule``: one penalty per rule, ``grad_penalty`` on params, ``input_grad_penalty``
   on modules (``@input``: the model's input); ``check``: no rule that splits the loss into
   tasks (per_loss) beside it, nor into examples (per_sample) beside a grad_penalty (each
   refused in one line; an input's term is each example's own, which per_sample follows), and
   the finite-difference form beside no other stage that runs its own passes.
2. attach: a forward pre-hook on each input rule's modules (``inputs.Inputs``), and a guard on
   each params rule's first parameter that refuses a backward filling ``.grad`` outside
   ``HookSet.backward`` (the penalty would silently be missing).
3. ``penalize`` (``HookSet.backward``, before any backward): on a step where a rule is due
   (``every``) and in its window, one ``torch.autograd.grad(loss, ..., create_graph=True)``
   over every due rule's parameters and inputs (untouched by the rules: it fills no
   ``.grad``), then ``loss + sum of terms``; the closure's loss (a sharpness stage's second
   pass) gains its own term at the moved point. The backward that fills ``.grad`` then holds
   the terms' gradients and every other stage acts on it.
   ``method: finite_difference`` (a grad_penalty rule) instead runs the backward itself
   (``backward``): ``g`` at ``theta``, then at ``theta + radius * g_S / ||g_S||``, and leaves
   ``(1 - a) g(theta) + a g(theta + radius u)`` with ``a = weight * c / radius`` (``c``: 1 for
   ``power: 1``, ``2 ||g_S||`` for ``power: 2``), Zhao et al. 2022's form of ``H u``.
4. ``finish``: nothing; the clock that says which steps are due is the HookSet's.

The loss a loop hands ``HookSet.backward`` may be scaled (fp16's loss scale, a division by the
micro-batches of a step: ``Core.grad_scale``, ``Core.loss_divisor``); the term is taken of the
unscaled loss and scaled as the loss is, so it is each micro-batch's own.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from gradmod.hooks import registry as R
from gradmod.hooks import stages
from gradmod.hooks.losses import summed, total
from gradmod.hooks.penalty.inputs import Inputs
from gradmod.hooks.penalty.terms import GradPenalty, InputGradPenalty, Penalty
from gradmod.hooks.second_pass import Copies, accumulate, running_stats_frozen, set_aside
from gradmod.hooks.stage import Core, Stage


@dataclass
class PenaltyRule:
    """One penalty rule: its term and what it differentiates (parameters, or modules' inputs)."""

    name: str
    term: Penalty
    params: list[nn.Parameter] = field(default_factory=list)
    inputs: list[Inputs] = field(default_factory=list)

    def trainable(self) -> list[nn.Parameter]:
        return [p for p in self.params if p.requires_grad]


class PenaltyStage(Stage):
    """The penalty rules of one ``attach`` call on ``model``."""

    name = "penalty"

    @classmethod
    def check_rule(cls, rule: str, kind: str, names: list[str], spec: Mapping[str, Any]) -> None:
        """One penalty per rule, on what its term differentiates."""
        if len(names) != 1:
            raise ValueError(
                f"hooks.{rule}.transforms: a penalty rule holds one penalty (grad_penalty or input_grad_penalty), "
                f"got {', '.join(names)}; put the others in rules of their own"
            )
        term = R.entry(names[0]).factory
        if isinstance(term, type) and issubclass(term, Penalty) and term.needs != kind:
            raise ValueError(
                f"hooks.{rule}: grad_penalty takes the loss's gradient on parameters (give params), "
                "input_grad_penalty on a module's input (give modules; @input: the model's)"
            )

    @classmethod
    def check(cls, model: nn.Module, targets: list) -> None:
        """No stage that splits the loss beside a penalty; the finite difference beside no other passes."""
        super().check(model, targets)
        mine = [t for t in targets if t.stage == cls.name]
        whole = next((t for t in mine if t.kind == "param"), mine[0])  # per example, only an input's term
        for t in targets:
            facts = stages.get(t.stage)
            if facts.several_losses or (facts.counts_examples and whole.kind == "param"):
                split = "tasks" if facts.several_losses else "examples"
                hint = "task's loss" if facts.several_losses else "example's loss: input_grad_penalty"
                raise ValueError(
                    f"hooks.{whole.rule}: a penalty rule takes the gradient of the whole loss, and {t.stage} rule "
                    f"{t.rule!r} splits it into {split}; use one of them (a penalty can sit inside one {hint}, "
                    "docs/guide/penalties.md)"
                )
        fd = next((t for t in targets if t.stage == cls.name and not t.steps[0].fn.exact), None)
        other = next((t for t in targets if stages.get(t.stage).runs_backward), None)
        if fd is not None and other is not None:
            raise ValueError(
                f"hooks.{fd.rule}: grad_penalty's finite_difference runs a second forward and backward itself, and "
                f"{other.stage} rule {other.rule!r} {stages.get(other.stage).runs_backward}; use method: exact"
            )

    def __init__(self, model: nn.Module, targets: list, core: Core):
        self.model, self.core = model, core
        self._copies = Copies()  # the finite difference's moved parameters, to move them back
        params, modules = dict(model.named_parameters()), dict(model.named_modules())
        self.rules: dict[str, PenaltyRule] = {}
        for t in targets:
            if t.stage != self.name:
                continue
            rule = self.rules.setdefault(t.rule, PenaltyRule(t.rule, t.steps[0].fn))
            if t.kind == "param":
                rule.params.append(params[t.name])
            else:
                where = f"module {t.name!r}" if t.name else "the model"
                rule.inputs.append(Inputs(t.rule, modules[t.name], where, self._due_now(rule)))
        # A backward filling .grad outside hooks.backward would silently leave the penalty out.
        self._handles = [r.params[0].register_hook(self._guard(r.name)) for r in self.rules.values() if r.params]
        self._handles += _math_attention(model, lambda: any(r.term.exact for r in self.due()))

    def _due_now(self, rule: PenaltyRule) -> Callable[[], bool]:
        return lambda: rule.name not in self.core.inactive and rule.term.due(self.core.step)

    def _guard(self, rule: str) -> Callable[[Tensor], None]:
        def hook(grad: Tensor) -> None:
            if not self.core.through_backward and self.core.fills_grad():
                raise RuntimeError(
                    f"hooks.{rule}: a penalty rule adds its term in hooks.backward(loss); call that, not loss.backward()"
                )

        return hook

    def refusal(self, error: RuntimeError) -> str | None:
        """An op of the model with no double backward in torch: one line naming it, else None."""
        found = re.search(r"derivative for (\S+) is not implemented", str(error))
        rule = self.double_backward()
        if found is None or rule is None:
            return None
        return (
            f"hooks.{rule}: torch has no double backward for {found.group(1)}, which the model's forward runs, so "
            "its exact penalty cannot be differentiated; select parameters or modules before that layer, or use "
            "grad_penalty's method: finite_difference"
        )

    def double_backward(self) -> str | None:
        return next((r.name for r in self.rules.values() if r.term.exact), None)

    def due(self) -> list[PenaltyRule]:
        """The rules that take their term on the optimizer step in progress."""
        return [r for r in self.rules.values() if self._due_now(r)()]

    def forward_passes(self) -> int:
        """2 where a finite-difference rule is due (its closure's forward), else 1."""
        return 2 if any(not r.term.exact for r in self.due()) else 1

    def penalize(self, losses: Tensor | Mapping[str, Tensor], closure: Callable[[], Any] | None) -> tuple[Any, Any]:
        """``losses`` with the due exact rules' terms added, and the closure whose loss gains its own."""
        due = [r for r in self.due() if r.term.exact]
        if not due:
            for r in self.rules.values():
                for i in r.inputs:
                    i.take()  # a forward of a step not due took nothing; a window's end drops what it took
            return losses, closure
        added = self._added(total(losses), due)
        if isinstance(losses, Tensor):
            out: Any = losses + added
        else:
            first = next(iter(losses))
            out = {k: v + added if k == first else v for k, v in losses.items()}
        if closure is None:
            return out, None
        return out, lambda: self._again(closure(), due)

    def _again(self, losses: Any, due: list[PenaltyRule]) -> Tensor:
        loss = summed(losses)
        return loss + self._added(loss, due)

    def _scale(self) -> Tensor | float:
        """What the loss handed in is multiplied by: fp16's loss scale over the micro-batches' divisor."""
        s = self.core.grad_scale
        return (1.0 if s is None else s) / self.core.loss_divisor

    def _added(self, loss: Tensor, due: list[PenaltyRule]) -> Tensor:
        """Every due rule's term, from one ``autograd.grad`` of ``loss`` (scaled by ``_scale``)."""
        wrt: list[list[Tensor]] = []
        for r in due:
            taken = r.trainable() if r.params else [x for i in r.inputs for x in i.take()]
            if not taken and r.inputs:
                where = ", ".join(i.where for i in r.inputs)
                raise ValueError(
                    f"hooks.{r.name}: input_grad_penalty saw no training forward of {where} since the last backward; "
                    "the loss must come from a forward of the selected modules"
                )
            wrt.append(taken)
        flat = [x for xs in wrt for x in xs]
        grads = torch.autograd.grad(loss, flat, create_graph=True, allow_unused=True) if flat else ()
        c = self._scale()
        out = loss.new_zeros(())
        i = 0
        for r, xs in zip(due, wrt):
            gs = [g for g in grads[i : i + len(xs)] if g is not None]
            i += len(xs)
            if gs:
                out = out + _term(r.term, gs, c, self.core)
        return out

    def backward(self, losses: Tensor | Mapping[str, Tensor], closure: Callable[[], Any] | None = None) -> bool:
        """Where a finite-difference rule is due: both passes, run here; else the backward is HookSet's."""
        fd = [r for r in self.due() if not r.term.exact]
        if not fd:
            return False
        if not callable(closure):
            raise ValueError(
                f"hooks.{fd[0].name}: grad_penalty with method: finite_difference needs a second forward: call "
                "hooks.backward(loss, closure=fn), fn() returning the loss recomputed at the current parameters"
            )
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        with set_aside(trainable) as held:
            total(losses).backward()
            mix = self._move(fd)
            for p in trainable:  # (1 - a) of the gradient at theta
                if p.grad is not None:
                    p.grad.mul_(1 - mix.a)
            accumulate(trainable, held)
            for p in trainable:
                p.grad = None
            try:
                with running_stats_frozen(self.model):
                    summed(closure()).backward()
            finally:
                with torch.no_grad():
                    torch._foreach_copy_(mix.moved, mix.saved)
            for p in trainable:  # a of the gradient at theta + radius u (the rules acted on each pass's own)
                if p.grad is not None:
                    p.grad.mul_(mix.a)
            accumulate(trainable, held)
        return True

    @torch.no_grad()
    def _move(self, fd: list[PenaltyRule]) -> _Mix:
        """Move each rule's parameters by ``radius * g_S / ||g_S||``; the weight ``a`` of the second pass."""
        c = self._scale()
        a, steps = 0.0, []
        for r in fd:
            ps = [p for p in r.trainable() if p.grad is not None]
            if not ps:
                continue
            term = r.term
            assert isinstance(term, GradPenalty)
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in ps]))
            per = 1.0 if term.power == 1 else 2 * float(norm / c)  # d||g||^p / d||g||
            a += term.scale * per / term.radius
            steps.append((ps, term.radius / float(norm.clamp_min(torch.finfo(norm.dtype).tiny))))
        moved = [p for ps, _ in steps for p in ps]
        saved = self._copies.of(moved)  # every rule's, before any moves
        for ps, step in steps:
            torch._foreach_add_(ps, [p.grad for p in ps], alpha=step)
        return _Mix(a, moved, saved)

    def remove(self) -> None:
        self._copies = Copies()
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for r in self.rules.values():
            for i in r.inputs:
                i.remove()


@dataclass
class _Mix:
    a: float  # the second pass's share of the gradient
    moved: list[Tensor]
    saved: list[Tensor]


def _math_attention(model: nn.Module, due: Callable[[], bool]) -> list[Any]:
    """Hooks that run the model's training forwards of a due step on torch's math attention
    kernel, the one whose backward can be differentiated again (the fused kernels' cannot)."""
    held: list[Any] = []

    def enter(module: nn.Module, args: Any) -> None:
        if torch.is_grad_enabled() and module.training and due():
            kernel = sdpa_kernel([SDPBackend.MATH])
            kernel.__enter__()
            held.append(kernel)

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        if held:
            held.pop().__exit__(None, None, None)

    return [model.register_forward_pre_hook(enter), model.register_forward_hook(leave, always_call=True)]


def _term(term: Penalty, grads: list[Tensor], c: Tensor | float, core: Core) -> Tensor:
    """``c * weight * ||g / c||^power`` of the rule's gradients (``c``: the loss's scale): over
    the parameters as one vector, or per example of each input, then their mean."""
    if isinstance(term, InputGradPenalty):
        out = grads[0].new_zeros(())
        for g in grads:
            dim = core.batch_dim or 0
            rows = g.movedim(dim, 0).flatten(1)
            per = len(rows) if core.loss_reduction == "mean" else 1  # each example's own loss's gradient
            norms = torch.linalg.vector_norm(rows, dim=1) * (per / c)
            out = out + norms.pow(term.power).mean()
        return c * term.scale * out
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])) / c
    return c * term.scale * norm.pow(term.power)
