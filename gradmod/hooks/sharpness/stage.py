"""The sharpness stage: the gradient at ``w + e`` instead of at ``w``, in two passes.

``HookSet.backward(loss, closure=fn)`` hands the stage the loss of the first forward and a
function that runs the second (``fn()`` recomputes the loss at the current parameters).
On an optimizer step where a rule is due (``every``), the stage:

1. runs the first backward to the due rules' parameters only (``backward(inputs=...)``),
   with their ``.grad`` set aside, so that gradient accumulation keeps what earlier
   micro-batches left there and this backward's gradient ``g`` stands alone;
2. per rule, ``e`` from ``g`` (its transform: ``sam``, ``asam``), copies the parameters
   into buffers it keeps from step to step and adds ``e`` to them;
3. runs the second forward and backward, which accumulates into ``.grad`` of every
   parameter as a plain backward does, with the normalisation layers' running statistics
   left as they were (``running_stats_frozen``);
4. copies the parameters back, bitwise, also when the second pass raised.

On a step where no rule is due, the first backward is a plain one and ``fn`` is not called.
Parameters outside every rule are not moved but get the gradient at the moved point
(SAM-ON: ``params: "*norm*"``). The optimizer steps counted by ``finish`` (one per
``after_backward``) decide which steps are due; they are the stage's ``state_dict``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
from torch import Tensor, nn
from torch.utils.weak import WeakIdKeyDictionary

from gradmod.hooks.sharded import is_sharded
from gradmod.hooks.sharpness.batchnorm import running_stats_frozen
from gradmod.hooks.sharpness.perturb import Perturbation


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


def refuse_sharded(targets: list[Any], params: Mapping[str, Tensor]) -> None:
    """FSDP2 shards the parameters and reduces ``.grad`` in its own backward hooks."""
    hit = next((t for t in targets if t.stage == "sharpness" and is_sharded(params[t.name])), None)
    if hit is not None:
        raise ValueError(
            f"hooks.{hit.rule}: sharpness rules do not run on FSDP-sharded parameters ({hit.name!r}) "
            "yet; use DDP or one process"
        )


def _with_grads(rules: list[SharpRule], grads: list[Tensor | None]):
    """(rule, its parameters with a first-pass gradient, those gradients), for each rule with any."""
    i = 0
    for r in rules:
        pairs = [(p, g) for p, g in zip(r.params, grads[i : i + len(r.params)]) if g is not None]
        i += len(r.params)
        if pairs:
            yield r, [p for p, _ in pairs], [g for _, g in pairs]


class SharpnessStage:
    """The sharpness rules of one ``attach`` call on ``model``."""

    def __init__(self, model: nn.Module, rules: list[SharpRule]):
        self.model = model
        self.rules = rules
        self.step = 0  # optimizer steps finished: which steps are due
        self.inside = False  # True while the stage runs its backward passes
        self._saved = WeakIdKeyDictionary()  # parameter -> the buffer it is copied into before it moves
        # A backward that reaches a rule outside hooks.backward would silently be plain.
        self._handles = [r.params[0].register_hook(self._guard(r.name)) for r in rules]

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

    def backward(self, loss: Tensor, again: Callable[[], None]) -> bool:
        """The first backward of ``loss`` and, where a rule is due, the second pass
        (``again``: forward and backward at the current parameters). True: two passes ran."""
        due = self.due()
        self.inside = True
        try:
            if not due:
                loss.backward()
                return False
            self._two_passes(loss, again, due)
            return True
        finally:
            self.inside = False

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
        return {"step": self.step}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.step = int(state["step"])

    def remove(self) -> None:
        self._saved = WeakIdKeyDictionary()
        for h in self._handles:
            h.remove()
        self._handles.clear()
