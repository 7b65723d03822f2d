"""Non-finite gradients: count them on the raw gradient and act as ``trainer.nonfinite`` says.

Raw counts come from two places: the hook chains (``HookSet.take_raw``), which count
before any transform runs, and, for parameters no hook sees, their ``.grad`` right
after backward (before the fused stage). A last check on the final ``.grad`` catches a
transform that *makes* a gradient non-finite (``scale`` by inf).

* ``warn`` (default): step anyway; counts stay on the device and are read, and warned
  about, once per epoch: no per-step host sync, the rule every other per-step statistic
  in gradmod follows.
* ``skip``: the optimizer step is not taken, so parameters and optimizer state stay as
  they were (one non-finite step written into Adam's moments poisons every later step);
  costs one host read of a few counts per step.
* ``raise``: stop with ``NonFiniteError`` naming the tensors (also one read per step).

Under fp16 a non-finite step is routine overflow: GradScaler skips it and halves the
scale whatever the policy. ``raise``/``warn`` apply once the scale is <= 1, where no
loss scaling explains the overflow.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor, nn

log = logging.getLogger(__name__)

POLICIES = ("skip", "raise", "warn")
AFTER = "(after transforms)"  # the name of the final-.grad check in reports


class NonFiniteError(RuntimeError):
    """Non-finite gradients under ``trainer.nonfinite=raise``."""


class NonFiniteGuard:
    def __init__(self, model: nn.Module, hooks=None, policy: str = "warn", world_sum=None):
        if policy not in POLICIES:
            raise ValueError(f"trainer.nonfinite={policy!r} is not allowed; allowed: {', '.join(POLICIES)}")
        self.policy = policy
        # DDP: hook-stage counts are local (before the all-reduce), so every rank must take
        # the same skip decision: ``world_sum`` sums a tensor over the ranks.
        self.world_sum = world_sum
        self.hooks = hooks
        hooked = hooks.hooked_params if hooks is not None else set()
        self.params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.unhooked = [(n, p) for n, p in self.params if n not in hooked]
        self.skipped = 0     # optimizer steps not taken
        self.bad_steps = 0   # steps with a non-finite raw (or final) gradient
        self.nonfinite = 0   # non-finite raw gradient entries, summed over steps
        self.steps = 0       # optimizer steps checked (the run's step count; messages name it)
        self._unhooked: dict[str, Tensor] = {}
        self._pending: tuple[list[str], Tensor, Tensor] | None = None  # warn: names, counts, bad steps

    def observe(self) -> None:
        """Count the raw ``.grad`` of parameters no hook sees; call right after backward."""
        for n, p in self.unhooked:
            if p.grad is not None:
                bad = (~torch.isfinite(p.grad)).sum()
                prev = self._unhooked.get(n)
                self._unhooked[n] = bad if prev is None else prev + bad

    def _collect(self) -> tuple[list[str], Tensor | None]:
        raw = (self.hooks.take_raw() if self.hooks is not None else []) + list(self._unhooked.items())
        self._unhooked = {}
        grads = [p.grad for _, p in self.params if p.grad is not None]
        if not raw and not grads:
            return [], None
        parts = [torch.stack([c.float() for _, c in raw])] if raw else []
        if grads:  # one fused norm per tensor: inf or nan iff the tensor has non-finite entries
            norms = torch.stack(torch._foreach_norm(grads))
            parts.append((~torch.isfinite(norms)).sum().float().reshape(1).to(norms.device))
        device = parts[0].device
        return [n for n, _ in raw] + ([AFTER] if grads else []), torch.cat([p.to(device) for p in parts])

    def check(self, scale: float | None = None) -> bool:
        """Call before each optimizer step; True when the step must be skipped.
        ``scale`` is GradScaler's scale under fp16, else None."""
        self.steps += 1
        names, counts = self._collect()
        if counts is None:
            return False
        if self.policy == "warn" and scale is None:
            self._accumulate(names, counts)
            return False
        if self.world_sum is not None:
            counts = torch.cat([counts, self.world_sum(counts.sum().reshape(1))])
        values = counts.tolist()  # the one host read per step
        if self.world_sum is not None:
            anywhere, values = values[-1], values[:-1]
            if anywhere and not any(values):  # only another rank saw it: skip with it
                self.skipped += 1
                return True
        if not any(values):
            return False
        self.bad_steps += 1
        self.nonfinite += int(sum(v for n, v in zip(names, values) if n != AFTER))
        where = _where(names, values)
        at = f" at step {self.steps}"
        if scale is not None and scale > 1:  # fp16 overflow: GradScaler's routine
            self.skipped += 1
            return True
        if self.policy == "raise":
            raise NonFiniteError(f"trainer.nonfinite=raise: non-finite gradient{at} in {where}; "
                                 "use trainer.nonfinite=skip to skip such steps")
        if self.policy == "warn":
            log.warning("non-finite gradient%s in %s (fp16: step skipped by GradScaler)", at, where)
            self.skipped += 1
            return True
        self.skipped += 1
        if self.skipped <= 10 or self.skipped % 100 == 0:
            log.warning("skipped optimizer step%s: non-finite gradient in %s (%d skipped so far)",
                        at, where, self.skipped)
        return True

    def _accumulate(self, names: list[str], counts: Tensor) -> None:
        if self._pending is not None and self._pending[0] != names:
            self.flush()
        bad = (counts > 0).any().float()
        if self._pending is None:
            self._pending = (names, counts.clone(), bad)
        else:
            self._pending[1].add_(counts)
            self._pending[2].add_(bad)

    def flush(self) -> None:
        """``warn``: read the pending counts (one host sync) and warn about them."""
        if self._pending is None:
            return
        names, counts, bad = self._pending
        self._pending = None
        host = torch.cat([counts, bad.reshape(1).to(counts.device)]).tolist()  # one host read
        values, steps = host[:-1], int(host[-1])
        if not steps:
            return
        self.bad_steps += steps
        self.nonfinite += int(sum(v for n, v in zip(names, values) if n != AFTER))
        log.warning("non-finite gradients in %d step(s), stepped anyway (trainer.nonfinite=warn): %s",
                    steps, _where(names, values))

    def state_dict(self) -> dict:
        self.flush()
        return {"skipped": self.skipped, "bad_steps": self.bad_steps, "nonfinite": self.nonfinite,
                "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.skipped, self.bad_steps, self.nonfinite = state["skipped"], state["bad_steps"], state["nonfinite"]
        self.steps = state["steps"]


def _where(names: list[str], values: list[float]) -> str:
    bad = [f"{n} ({int(v)})" if n != AFTER else n for n, v in zip(names, values) if v]
    more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
    return ", ".join(bad[:5]) + more
