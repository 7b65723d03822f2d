"""Privacy accounting for DP-SGD with Opacus' accountants (the ``privacy`` extra).

An accountant composes one sampled Gaussian mechanism per optimizer step (noise multiplier
sigma, sample rate q) and converts the whole run into epsilon at a given delta. gradmod does
no accounting of its own: ``rdp`` is Opacus' ``RDPAccountant`` (Mironov et al. 2019), ``prv``
its ``PRVAccountant`` (Gopi et al. 2021, tighter). ``PrivacyCallback`` steps the accountant
after every optimizer step, puts epsilon in each epoch's record (``metrics.jsonl``) and keeps
the accountant's history in checkpoints, so a resumed run's epsilon is an uninterrupted one's.
"""

from __future__ import annotations

import logging
import math
import warnings
from typing import Any, Callable

from gradmod.training.callbacks import Callback

log = logging.getLogger(__name__)

INSTALL = 'pip install "gradmod[privacy]" (Opacus, for its accountants)'


def make_accountant(name: str):
    """Opacus' accountant ``rdp`` or ``prv``; a one-line error when Opacus is missing."""
    try:
        from opacus.accountants import PRVAccountant, RDPAccountant
    except ImportError:
        raise ValueError(f"a per_sample rule adds noise, and its privacy accounting needs Opacus: {INSTALL}") from None
    return {"rdp": RDPAccountant, "prv": PRVAccountant}[name]()


# The noise multipliers a target is searched between: below the lowest a target is so loose
# that it says nothing (set the noise yourself), above the highest it cannot be reached.
SIGMA_RANGE = (0.1, 1e4)


def epsilon_of(history: list[tuple[float, float, int]], delta: float, accountant: str) -> float:
    acc = make_accountant(accountant)
    acc.history = list(history)
    with warnings.catch_warnings():  # the range-end probes sit outside the orders RDP tries
        warnings.simplefilter("ignore", UserWarning)
        return float(acc.get_epsilon(delta))


def noise_for_epsilon(target_epsilon: float, delta: float, sample_rate: float, steps: int, accountant: str) -> float:
    """The smallest noise multiplier whose ``steps`` steps at ``sample_rate`` stay within
    ``target_epsilon`` at ``delta`` (Opacus' ``get_noise_multiplier``, a bisection), after
    two conversions at the ends of ``SIGMA_RANGE`` refuse a target it cannot find, in one line."""
    if not (math.isfinite(target_epsilon) and target_epsilon > 0):
        raise ValueError(f"privacy.target_epsilon={target_epsilon} must be a finite number > 0, or null")
    low, high = SIGMA_RANGE
    if epsilon_of([(high, sample_rate, steps)], delta, accountant) > target_epsilon:
        raise ValueError(
            f"privacy.target_epsilon={target_epsilon} is unreachable: even noise_multiplier={high:g} "
            f"gives more over {steps} steps at sample rate {sample_rate:.5f}; raise the target or train "
            "fewer steps"
        )
    loose = epsilon_of([(low, sample_rate, steps)], delta, accountant)
    if loose <= target_epsilon:
        raise ValueError(
            f"privacy.target_epsilon={target_epsilon} bounds nothing: noise_multiplier={low:g} already "
            f"gives epsilon {loose:.4g} over {steps} steps; lower the target or set the rule's "
            "noise_multiplier"
        )
    from opacus.accountants.utils import get_noise_multiplier

    return float(
        get_noise_multiplier(
            target_epsilon=target_epsilon,
            target_delta=delta,
            sample_rate=sample_rate,
            steps=steps,
            accountant=accountant,
        )
    )


def history_of(sigmas: list[float], sample_rate: float) -> list[tuple[float, float, int]]:
    """Per-step noise multipliers as an accountant's history: runs of one value, counted."""
    out: list[tuple[float, float, int]] = []
    for s in sigmas:
        if out and out[-1][0] == s:
            out[-1] = (s, sample_rate, out[-1][2] + 1)
        else:
            out.append((s, sample_rate, 1))
    return out


def scale_for_epsilon(
    target_epsilon: float, delta: float, sample_rate: float, sigmas: list[float], accountant: str
) -> float:
    """The smallest factor for a noise schedule (every step's multiplier times it) whose run
    stays within ``target_epsilon``: a bisection as Opacus' ``get_noise_multiplier`` does
    for one multiplier, to within 0.01 below the target; refused in one line out of reach."""
    if not (math.isfinite(target_epsilon) and target_epsilon > 0):
        raise ValueError(f"privacy.target_epsilon={target_epsilon} must be a finite number > 0, or null")

    def eps(scale: float) -> float:
        return epsilon_of(history_of([scale * s for s in sigmas], sample_rate), delta, accountant)

    low, high = (r / max(sigmas) for r in SIGMA_RANGE)  # the largest step within the constant case's range
    if eps(high) > target_epsilon:
        raise ValueError(
            f"privacy.target_epsilon={target_epsilon} is unreachable with this noise schedule: even scaled "
            f"by {high:g} it gives more over {len(sigmas)} steps; raise the target or train fewer steps"
        )
    if eps(low) <= target_epsilon:
        raise ValueError(
            f"privacy.target_epsilon={target_epsilon} bounds nothing: the noise schedule scaled by {low:g} "
            "already stays within it; lower the target or set the schedule itself"
        )
    while True:
        mid = (low + high) / 2
        e = eps(mid)
        if e <= target_epsilon:
            high = mid
            if target_epsilon - e <= 0.01:
                return high
        else:
            low = mid


class PrivacyCallback(Callback):
    """Counts every optimizer step (a skipped one too: its gradient saw the data) as one
    sampled Gaussian mechanism; ``epsilon`` in each epoch's record and in ``summary()``.
    The accountant's history composes steps of different noise and sample rate (a resume
    may change the batch size); what the claim also rests on (accountant, delta, sampling)
    a resume must keep, else it is refused. ``target_epsilon``: the run keeps the noise
    its start chose for it (``clip``, the noisy rule's transform, gets it back on resume)."""

    key = "privacy"
    before = {"Checkpointer": "its state in the step's checkpoint", "RunFiles": "epsilon in the epoch's record"}

    def __init__(
        self,
        accountant: str,
        delta: float,
        noise_multiplier: float,
        sample_rate: float,
        sampling: str = "poisson",
        target_epsilon: float | None = None,
        clip: Any = None,
        noise_at: Callable[[int], float] | None = None,
    ):
        self.name, self.delta, self.sampling, self.target = accountant, delta, sampling, target_epsilon
        self.noise_at = noise_at  # a scheduled noise multiplier: step t's value
        self.noise_multiplier, self.sample_rate, self.clip = noise_multiplier, sample_rate, clip
        self.accountant = make_accountant(accountant)
        self._cached: tuple[int, float] = (0, 0.0)  # (steps, epsilon)

    @property
    def steps(self) -> int:
        return sum(int(n) for _, _, n in self.accountant.history)

    def on_step_end(self, trainer) -> None:
        sigma = (
            self.noise_multiplier if self.noise_at is None else self.noise_at(trainer.step - 1)
        )  # the step just taken
        self.accountant.step(noise_multiplier=sigma, sample_rate=self.sample_rate)

    def on_epoch_end(self, trainer, record: dict[str, Any]) -> None:
        record["epsilon"] = self.epsilon()
        log.info(
            "epoch %s: epsilon %.4f at delta %g after %d steps (%s accountant)",
            record.get("epoch", "?"),
            record["epsilon"],
            self.delta,
            self.steps,
            self.name,
        )

    def epsilon(self) -> float:
        """Epsilon after the steps so far (computed once per step count: a PRV or RDP
        conversion takes up to a second)."""
        if self._cached[0] != self.steps:
            value = float(self.accountant.get_epsilon(self.delta)) if self.accountant.history else 0.0
            self._cached = (self.steps, value)
        return self._cached[1]

    def summary(self) -> dict[str, Any]:
        """summary.json's ``privacy`` block: the epsilon spent by every step so far."""
        out = {
            "epsilon": self.epsilon(),
            "delta": self.delta,
            "accountant": self.name,
            "noise_multiplier": self._noise_history(),
            "sample_rate": self.sample_rate,
            "steps": self.steps,
            "history": [[float(s), float(q), int(n)] for s, q, n in self.accountant.history],
        }
        if self.target is not None:
            out.update(target_epsilon=self.target, target_exceeded=out["epsilon"] > self.target)
        return out

    def _noise_history(self) -> float | list[float]:
        """The noise multiplier every step had, or (a resume that changed it) each one in the
        order the steps had it: the epsilon rests on all of them."""
        sigmas = list(dict.fromkeys(float(s) for s, _, _ in self.accountant.history)) or [self.noise_multiplier]
        return sigmas[0] if len(sigmas) == 1 else sigmas

    def state_dict(self) -> dict[str, Any]:
        return {
            "history": [[float(s), float(q), int(n)] for s, q, n in self.accountant.history],
            "accountant": self.name,
            "delta": self.delta,
            "sampling": self.sampling,
            "target_epsilon": self.target,
            "noise_multiplier": self.noise_multiplier,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, mine in (("accountant", self.name), ("delta", self.delta), ("sampling", self.sampling)):
            if key in state and state[key] != mine:
                raise ValueError(
                    f"the checkpoint's privacy {key} was {state[key]!r}, this run's is {mine!r}; the "
                    "claim covers the whole history, so resume with the same, or start a new run"
                )
        history = [(float(s), float(q), int(n)) for s, q, n in state.get("history", [])]
        if any(s <= 0 for s, _, _ in history):
            raise ValueError("the checkpoint's history has steps without noise; no privacy claim holds for it")
        self.accountant.history = history
        self._cached = (0, 0.0)
        kept = state.get("noise_multiplier")
        if (
            self.noise_at is None
            and self.target is not None
            and state.get("target_epsilon") == self.target
            and kept not in (None, self.noise_multiplier)
        ):
            log.info(
                "privacy.target_epsilon=%s: keeping the noise_multiplier %.4f chosen at the run's start "
                "(not %.4f for the extended plan); epsilon may exceed the target",
                self.target,
                kept,
                self.noise_multiplier,
            )
            self.noise_multiplier = kept
            if self.clip is not None:
                self.clip.noise_multiplier = kept

    def on_missing_state(self, steps: int) -> None:
        if steps:
            raise ValueError(
                f"the checkpoint's {steps} steps ran without noise (no privacy accounting); a privacy "
                "claim for this run would be false: start a new run"
            )
