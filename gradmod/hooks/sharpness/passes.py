"""What the sharpness stage's passes hold: the rules and each due rule's first-pass gradients."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from torch import Tensor, nn

from gradmod.hooks.sharpness.perturb import Ascent, Perturbation, _unbent


@dataclass
class SharpRule:
    """One sharpness rule: its transform, the parameters it moves, and what shapes ``g``
    before the move (the rule's transforms before the sharpness one, in order)."""

    name: str
    transform: Perturbation
    params: list[nn.Parameter]
    before: list[Callable[[list[Tensor]], None]] = field(default_factory=list)

    def trainable(self) -> list[nn.Parameter]:
        """The rule's parameters that take a gradient now (``requires_grad`` read at this step)."""
        return [p for p in self.params if p.requires_grad]

    def ascent(self, step: int, lr: float | None, first: bool, scale: Tensor | None) -> Ascent:
        return Ascent(step, lr, self._bend if self.before else _unbent, first, scale)

    def _bend(self, grads: list[Tensor]) -> None:
        for shape in self.before:
            shape(grads)


def sharpness_rules(targets: list[Any], params: Mapping[str, nn.Parameter]) -> list[SharpRule]:
    """The sharpness rules among ``targets`` (``gradmod.hooks.rules.targets.Target``), in config order."""
    out: dict[str, SharpRule] = {}
    for t in targets:
        if t.stage == "sharpness":
            before = [s.fn for s in t.steps[:-1]]
            rule = out.setdefault(t.rule, SharpRule(t.rule, t.steps[-1].fn, [], before))
            rule.params.append(params[t.name])
    return list(out.values())


@dataclass
class Taken:
    """One due rule on one micro-batch: its parameters the first pass reached, their ``g``."""

    rule: SharpRule
    params: list[Tensor]
    grads: list[Tensor]

    @staticmethod
    def split(live: list[tuple[SharpRule, list[Tensor]]], grads: list[Tensor | None]) -> list[Taken]:
        """``grads`` (the first pass's, of every live parameter in order) per rule, leaving
        out the parameters it did not reach and the rules it reached none of."""
        out, i = [], 0
        for rule, ps in live:
            pairs = [(p, g) for p, g in zip(ps, grads[i : i + len(ps)]) if g is not None]
            i += len(ps)
            if pairs:
                out.append(Taken(rule, [p for p, _ in pairs], [g for _, g in pairs]))
        return out

    def second(self) -> list[Tensor]:
        """The gradients the second pass left in ``.grad`` (zeros where it reached none)."""
        return [p.grad if p.grad is not None else p.detach().new_zeros(p.shape) for p in self.params]
