"""Which parameters train in this step, read from ``requires_grad`` as each training forward
starts and again as it ends (a model's own ``forward`` may freeze or unfreeze a layer).

Training freezes and unfreezes layers as it goes. A rule selects by its globs the parameters
frozen at attach too (``rules.build_targets``), and the stage follows every one of them
from the first forward (its trace holds them trainable, even where the model's ``forward``
switches them off: ``trace.held``), so that each backward clips and noises exactly the
rule's parameters that train now: a frozen one keeps ``.grad = None`` (no noise, no step
moves it), one unfrozen later is clipped with its rule. With noise, a parameter that trains
outside the noisy rule would make the privacy claim false: refused in one line before its
backward.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from torch import nn

from gradmod.hooks.per_sample.assign import Layer


class Trainable:
    """``live``: ids of the rules' parameters that train now; ``changed()`` answers True
    (once) when some parameter of the model was frozen or unfrozen since the last call."""

    def __init__(self, model: nn.Module, rules: list):
        self._named = [(n, p) for n, p in model.named_parameters()]
        self._rules = rules
        self._state: tuple[bool, ...] | None = None
        self.live: set[int] = set()
        self.every_live = True  # no parameter of a rule is frozen: a layer's names as they are

    def changed(self) -> bool:
        state = tuple(p.requires_grad for _, p in self._named)
        if state == self._state:
            return False
        self._state = state
        self.live = {id(p) for r in self._rules for p in r.params if p.requires_grad}
        self.every_live = all(id(p) in self.live for r in self._rules for p in r.params)
        return True

    def names(self, layer: Layer) -> dict[str, nn.Parameter]:
        """The layer's parameters that train now (local name -> parameter)."""
        if self.every_live:
            return layer.names
        return {n: p for n, p in layer.names.items() if id(p) in self.live}

    def refuse_outside(self) -> None:
        """With noise, every parameter that trains is in the noisy rule, else one line."""
        noisy = next((r.name for r in self._rules if r.clip and r.clip.noise_multiplier > 0), None)
        if noisy is None:
            return
        rule_of = {id(p): r for r in self._rules for p in r.params}
        for n, p in self._named:
            r = rule_of.get(id(p))
            if p.requires_grad and (r is None or r.name != noisy):
                where = f"rule {r.name}, no noise" if r is not None else "no rule"
                raise ValueError(
                    f"hooks.{noisy}: {n!r} trains now (requires_grad=True) outside that rule ({where}), so "
                    f"its update is not private and the privacy claim would be false; select it in "
                    f"hooks.{noisy} or keep it frozen"
                )


@contextmanager
def all_trainable(params: Iterable[nn.Parameter]) -> Iterator[None]:
    """The frozen ones of ``params`` with ``requires_grad`` on for a moment: the trace sees
    their uses (autograd connects them), a tensor hook can be registered on them."""
    frozen = [p for p in params if not p.requires_grad]
    for p in frozen:
        p.requires_grad_(True)
    try:
        yield
    finally:
        for p in frozen:
            p.requires_grad_(False)
