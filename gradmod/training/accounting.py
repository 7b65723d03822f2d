"""DP-SGD for a loop of your own: the privacy spent by ``attach``'s per_sample rules, and
the Poisson batches that spending assumes (the ``privacy`` extra: Opacus' accountants).

A step of DP-SGD (each example clipped, the sum noised once) with Poisson sampling is one
sampled Gaussian mechanism (noise multiplier sigma, sample rate q); an accountant composes
the steps taken and converts them into epsilon at a delta. ``epsilon`` does it for steps of
one sigma and q; ``Accountant`` for a loop whose sigma or q changes. Both are Opacus'
accountants (``rdp``, ``prv``, ``gdp``, or any registered with ``opacus.accountants``), fed
the same history gradmod's trainer feeds them, so a plain loop reports the trainer's epsilon.
``PoissonSampler`` draws the batches (each example in each step's batch with probability q,
independently: sizes vary and may be zero; an empty step still adds its noise).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator

import torch
from torch.utils.data import Sampler

INSTALL = 'pip install "gradmod[privacy]" (Opacus, for its accountants)'


def _check(name: str, value, ok: bool, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{name}={value!r}; allowed: {allowed}")


def _opacus_accountant(name: str):
    try:
        from opacus.accountants import create_accountant
        from opacus.accountants.registry import _ACCOUNTANTS
    except ImportError:
        raise ValueError(f"privacy accounting needs Opacus: {INSTALL}") from None
    _check("accountant", name, name in _ACCOUNTANTS, ", ".join(sorted(_ACCOUNTANTS)))
    return create_accountant(name)


class Accountant:
    """Steps of DP-SGD composed into epsilon at ``delta`` by Opacus' ``accountant``. Call
    ``step(noise_multiplier, sample_rate)`` after every optimizer step (a skipped one too:
    its gradient saw the data); ``epsilon()`` is the privacy spent so far."""

    def __init__(self, delta: float, accountant: str = "rdp"):
        _check("delta", delta, isinstance(delta, (int, float)) and 0 < delta < 1, "a number in (0, 1)")
        self.delta, self.name = float(delta), accountant
        self._opacus = _opacus_accountant(accountant)

    def step(self, noise_multiplier: float, sample_rate: float, steps: int = 1) -> None:
        _check(
            "noise_multiplier",
            noise_multiplier,
            isinstance(noise_multiplier, (int, float)) and math.isfinite(noise_multiplier) and noise_multiplier > 0,
            "a finite number > 0 (without noise there is no privacy to account)",
        )
        _check("sample_rate", sample_rate, isinstance(sample_rate, (int, float)) and 0 < sample_rate <= 1, "(0, 1]")
        _check("steps", steps, isinstance(steps, int) and not isinstance(steps, bool) and steps >= 0, "an int >= 0")
        history = self._opacus.history
        if history and history[-1][:2] == (float(noise_multiplier), float(sample_rate)):
            history[-1] = (*history[-1][:2], history[-1][2] + steps)  # one entry per (sigma, q), as Opacus keeps
        elif steps:
            history.append((float(noise_multiplier), float(sample_rate), steps))

    @property
    def steps(self) -> int:
        return sum(int(n) for _, _, n in self._opacus.history)

    @property
    def history(self) -> list[tuple[float, float, int]]:
        """(noise multiplier, sample rate, steps) per run of equal steps, as Opacus keeps it."""
        return list(self._opacus.history)

    def epsilon(self) -> float:
        if not self._opacus.history:
            return 0.0
        with warnings.catch_warnings():  # RDP's note that the best order is the largest it tried
            warnings.simplefilter("ignore", UserWarning)
            return float(self._opacus.get_epsilon(self.delta))


def epsilon(steps: int, sample_rate: float, noise_multiplier: float, delta: float, accountant: str = "rdp") -> float:
    """Epsilon at ``delta`` after ``steps`` steps of DP-SGD with Poisson sampling at
    ``sample_rate`` (expected batch / training set size) and ``noise_multiplier`` (the noisy
    rule's ``per_sample_clip`` ``noise_multiplier``), by Opacus' ``accountant``."""
    acc = Accountant(delta, accountant)
    acc.step(noise_multiplier, sample_rate, steps)
    return acc.epsilon()


class PoissonSampler(Sampler[list[int]]):
    """``steps`` batches of indices into ``num_examples`` examples, each example in each
    batch independently with probability ``sample_rate`` (the sampling the accountants
    assume). Give it to a DataLoader as ``batch_sampler``; set the per_sample stage's divisor
    to the expected batch size ``sample_rate * num_examples``:
    ``hooks.set_up(gradmod.hooks.stage.Loop(poisson=True, step_examples=...))``. An empty batch is possible: run the step anyway (the model's forward on
    zero examples, then ``after_backward()`` adds the noise; a loop may also skip the forward
    and call ``after_backward()`` alone)."""

    def __init__(self, num_examples: int, sample_rate: float, steps: int, generator: torch.Generator | None = None):
        _check("num_examples", num_examples, isinstance(num_examples, int) and num_examples > 0, "an int > 0")
        _check("sample_rate", sample_rate, isinstance(sample_rate, (int, float)) and 0 < sample_rate <= 1, "(0, 1]")
        _check("steps", steps, isinstance(steps, int) and steps >= 0, "an int >= 0")
        self.num_examples, self.sample_rate, self.steps, self.generator = num_examples, sample_rate, steps, generator

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[list[int]]:
        for _ in range(self.steps):
            mask = torch.rand(self.num_examples, generator=self.generator) < self.sample_rate
            yield mask.nonzero().flatten().tolist()
