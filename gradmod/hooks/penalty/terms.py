"""What a penalty rule adds to the loss: ``weight * ||g||^power``, from the loss's gradient.

* ``grad_penalty`` (a params rule): ``g`` is the loss's gradient on the rule's parameters,
  all of them as one vector (gradient-norm regularization; ``power: 1`` is Zhao et al. 2022's
  ``||g||``, ``power: 2``, the default, its square).
* ``input_grad_penalty`` (a modules rule; ``@input``: the model's own input): ``g_i`` is
  example ``i``'s loss's gradient with respect to its input to each selected module, and the
  term is ``weight * mean_i ||g_i||^power`` (double backprop; R1's form for a classifier).

Both are taken every ``every`` optimizer steps with their weight times ``every`` (lazy
regularization, as StyleGAN2 does), so that the penalty's mean over a run stays the same.
Arguments are plain attributes: a schedule (``weight: {schedule: linear, ...}``) retunes them
at the step boundary (``gradmod.hooks.rules.timed``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

METHODS = ("exact", "finite_difference")


@dataclass
class Penalty:
    """``weight * ||g||^power`` every ``every`` optimizer steps (weight times ``every`` then)."""

    weight: float = 1.0
    power: int = 2
    every: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.weight, bool) or not isinstance(self.weight, (int, float)) or not self.weight >= 0:
            raise ValueError(f"{self.name}: weight={self.weight!r} must be a number >= 0")
        if not math.isfinite(self.weight):
            raise ValueError(f"{self.name}: weight={self.weight!r} must be finite")
        if self.power not in (1, 2) or isinstance(self.power, bool):
            raise ValueError(f"{self.name}: power={self.power!r}; allowed: 1 (||g||) or 2 (||g||^2)")
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"{self.name}: every={self.every!r} must be an int >= 1 (optimizer steps)")

    name = "penalty"
    needs = "param"  # the rule kind that names what the gradient is taken of (a params rule)

    @property
    def exact(self) -> bool:
        """Its term is differentiated by a double backward (not a finite difference)."""
        return True

    def due(self, step: int) -> bool:
        """Taken at this optimizer step (steps done so far: ``step``)."""
        return step % self.every == 0 and self.weight > 0

    @property
    def scale(self) -> float:
        """The weight a due step uses: lazy regularization keeps the mean over steps."""
        return float(self.weight) * self.every


@dataclass
class GradPenalty(Penalty):
    """``weight * ||dL/dtheta_S||^power``, ``S`` the rule's parameters. ``method``: ``exact``
    (a double backward) or ``finite_difference`` (one more forward and backward at
    ``theta + radius * g/||g||`` on ``S``, Zhao et al. 2022; ``hooks.backward(loss, closure=fn)``)."""

    method: str = "exact"
    radius: float = 0.01

    name = "grad_penalty"

    @property
    def exact(self) -> bool:
        return self.method == "exact"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.method not in METHODS:
            raise ValueError(f"grad_penalty: method={self.method!r}; allowed: {', '.join(METHODS)}")
        if isinstance(self.radius, bool) or not isinstance(self.radius, (int, float)) or not self.radius > 0:
            raise ValueError(f"grad_penalty: radius={self.radius!r} must be a number > 0 (finite_difference's step)")


@dataclass
class InputGradPenalty(Penalty):
    """``weight * mean_i ||d l_i / d x_i||^power``, ``x`` each selected module's input."""

    name = "input_grad_penalty"
    needs = "module"  # a modules rule: their inputs
