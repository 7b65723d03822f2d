"""Privacy accounting for DP-SGD with Opacus' accountants (the ``privacy`` extra).

An accountant composes one sampled Gaussian mechanism per optimizer step (noise multiplier
sigma, sample rate q) and converts the whole run into epsilon at a given delta. gradmod does
no accounting of its own: ``rdp`` is Opacus' ``RDPAccountant`` (Mironov et al. 2019), ``prv``
its ``PRVAccountant`` (Gopi et al. 2021, tighter). ``PrivacyCallback`` steps the accountant
after every optimizer step, puts epsilon in each epoch's record (``metrics.jsonl``) and keeps
the accountant's history in checkpoints, so a resumed run's epsilon is an uninterrupted one's.
"""

from __future__ import annotations

from typing import Any

from gradmod.training.callbacks import Callback

INSTALL = 'pip install "gradmod[privacy]" (Opacus, for its accountants)'


def make_accountant(name: str):
    """Opacus' accountant ``rdp`` or ``prv``; a one-line error when Opacus is missing."""
    try:
        from opacus.accountants import PRVAccountant, RDPAccountant
    except ImportError:
        raise ValueError(f"a per_sample rule adds noise, and its privacy accounting needs Opacus: {INSTALL}") from None
    return {"rdp": RDPAccountant, "prv": PRVAccountant}[name]()


def noise_for_epsilon(target_epsilon: float, delta: float, sample_rate: float, steps: int, accountant: str) -> float:
    """The smallest noise multiplier whose ``steps`` steps at ``sample_rate`` stay within
    ``target_epsilon`` at ``delta`` (Opacus' ``get_noise_multiplier``, a bisection)."""
    make_accountant(accountant)  # the same one-line error when Opacus is missing
    from opacus.accountants.utils import get_noise_multiplier

    try:
        return float(get_noise_multiplier(target_epsilon=target_epsilon, target_delta=delta,
                                          sample_rate=sample_rate, steps=steps, accountant=accountant))
    except ValueError as e:
        raise ValueError(f"privacy.target_epsilon={target_epsilon}: no noise multiplier reaches it "
                         f"({' '.join(str(e).split())})") from None


class PrivacyCallback(Callback):
    """Counts every optimizer step (a skipped one too: its gradient saw the data) as one
    sampled Gaussian mechanism; ``epsilon`` in each epoch's record and in ``summary()``."""

    key = "privacy"
    before = {"Checkpointer": "its state in the step's checkpoint", "RunFiles": "epsilon in the epoch's record"}

    def __init__(self, accountant: str, delta: float, noise_multiplier: float, sample_rate: float):
        self.name, self.delta = accountant, delta
        self.noise_multiplier, self.sample_rate = noise_multiplier, sample_rate
        self.accountant = make_accountant(accountant)
        self._cached: tuple[int, float] = (0, 0.0)  # (steps, epsilon)

    @property
    def steps(self) -> int:
        return sum(int(n) for _, _, n in self.accountant.history)

    def on_step_end(self, trainer) -> None:
        self.accountant.step(noise_multiplier=self.noise_multiplier, sample_rate=self.sample_rate)

    def on_epoch_end(self, trainer, record: dict[str, Any]) -> None:
        record["epsilon"] = self.epsilon()

    def epsilon(self) -> float:
        """Epsilon after the steps so far (computed once per step count: a PRV or RDP
        conversion takes up to a second)."""
        if self._cached[0] != self.steps:
            value = float(self.accountant.get_epsilon(self.delta)) if self.accountant.history else 0.0
            self._cached = (self.steps, value)
        return self._cached[1]

    def summary(self) -> dict[str, Any]:
        """summary.json's ``privacy`` block."""
        return {"epsilon": self.epsilon(), "delta": self.delta, "accountant": self.name,
                "noise_multiplier": self.noise_multiplier, "sample_rate": self.sample_rate, "steps": self.steps}

    def state_dict(self) -> dict[str, Any]:
        return {"history": [[float(s), float(q), int(n)] for s, q, n in self.accountant.history]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.accountant.history = [(float(s), float(q), int(n)) for s, q, n in state.get("history", [])]
        self._cached = (0, 0.0)
