"""Non-finite gradients: count them on the raw gradient and act as ``trainer.nonfinite`` says.

What is counted is non-finite *entries* (inf, -inf, nan), never a norm that overflows:
a step whose entries are all finite but huge (lr 1e10) is not a non-finite step. Counting
is batched: each step, one ``torch._foreach_mul`` by 0 (inf * 0 and nan * 0 are nan) and
one ``torch._foreach_norm(ord=0)`` (the count of nonzero, i.e. nan, entries) cover every
tensor at once, whatever the number of parameters.

Raw gradients are the hook chains' inputs where a chain replaced the gradient
(``HookSet.take_raw_parts``), and ``.grad`` elsewhere: right after backward (``observe``)
when a fused stage will transform it, else at ``check``. A last count on the final ``.grad``
of every transformed tensor catches a transform that *makes* a gradient non-finite (``scale``
by inf); those entries are reported as ``(after transforms)`` and mark the step, but are not
raw entries, so ``nonfinite`` leaves them out.

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

from gradmod.hooks import stages
from gradmod.hooks.mesh.reductions import first_replica, local

log = logging.getLogger(__name__)

POLICIES = ("skip", "raise", "warn")
AFTER = "(after transforms)"  # marks the final-.grad counts in reports
FOLD_AT = 256  # warn: pending per-step counts folded into one row on the device, so memory stays bounded


def count_nonfinite(tensors: list[Tensor]) -> list[Tensor]:
    """The number of non-finite entries of each tensor (0-d device tensors, float): two
    ops for the whole list, no host sync."""
    if not tensors:
        return []
    # FSDP2, tensor parallelism: this rank's pieces, counted on one replica of each only
    # (the counts are summed over every rank).
    owned = [first_replica(t) for t in tensors]
    counts = torch._foreach_norm(torch._foreach_mul([local(t) for t in tensors], 0), 0)
    return [c if own else c * 0 for c, own in zip(counts, owned)]


class Diverged(RuntimeError):
    """The run's numbers became non-finite at optimizer step ``step``: it ends with status
    ``diverged`` and exit status 3 (``gradmod.run.folder.endings``)."""

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.step = step


class NonFiniteError(Diverged):
    """Non-finite gradients under ``trainer.nonfinite=raise``."""


class NonFiniteGuard:
    def __init__(self, model: nn.Module, hooks=None, policy: str = "warn", world_sum=None, sharded: bool = False):
        if policy not in POLICIES:
            raise ValueError(f"trainer.nonfinite={policy!r} is not allowed; allowed: {', '.join(POLICIES)}")
        self.policy = policy
        # DDP: hook-stage counts are local (before the all-reduce), so every rank must take
        # the same skip decision: ``world_sum`` sums a tensor over the ranks.
        self.world_sum = world_sum
        self.sharded = sharded  # FSDP2: each rank counts its shards, summed over the ranks every step
        self.hooks = hooks
        self.params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        # Parameters whose .grad the fused stage transforms in place: counted before it.
        # The parameters whose accumulated .grad a stage transforms in place after backward.
        self.fused = {t.name for t in hooks.targets if stages.get(t.stage).in_place} if hooks is not None else set()
        self.skipped = 0  # optimizer steps not taken
        self.bad_steps = 0  # steps with a non-finite raw (or final) gradient
        self.nonfinite = 0  # non-finite raw gradient entries, summed over steps
        self.steps = 0  # optimizer steps checked (the run's step count; messages name it)
        self._early: list[tuple[str, Tensor]] = []  # observe()'s counts for this step
        self._pending: _Pending | None = None  # warn: the counts of the steps since the last flush

    def observe(self) -> None:
        """Right after backward, before a fused stage changes ``.grad``: count the raw
        ``.grad`` of the parameters the fused stage will transform (else ``check`` does)."""
        if not self.fused:
            return
        replaced = self.hooks.replaced if self.hooks is not None else set()
        named = [(n, p.grad) for n, p in self.params if p.grad is not None and n in self.fused and n not in replaced]
        self._early.extend(zip([n for n, _ in named], count_nonfinite([g for _, g in named])))

    def _collect(self) -> tuple[list[str], list[bool], Tensor | None]:
        """(names, which are after-transform counts, the counts as one device vector)."""
        raw, counted, replaced = self.hooks.take_raw_parts() if self.hooks is not None else ([], [], set())
        early, self._early = self._early, []
        seen = {n for n, _ in early} | replaced
        from_grad = [(n, p.grad) for n, p in self.params if p.grad is not None and n not in seen]
        after = [(n, p.grad) for n, p in self.params if p.grad is not None and (n in replaced or n in self.fused)]
        named = raw + from_grad + after
        counts = count_nonfinite([t for _, t in named]) + [c for _, c in early + counted]
        if not counts:
            return [], [], None
        names = [n for n, _ in raw + from_grad] + [f"{n} {AFTER}" for n, _ in after] + [n for n, _ in early + counted]
        is_after = [False] * len(raw + from_grad) + [True] * len(after) + [False] * len(early + counted)
        return names, is_after, torch.stack(counts)

    def check(self, scale: float | None = None) -> bool:
        """Call before each optimizer step; True when the step must be skipped.
        ``scale`` is GradScaler's scale under fp16, else None."""
        self.steps += 1
        names, is_after, counts = self._collect()
        if counts is None:
            return False
        if self.sharded:
            counts = self.world_sum(counts)
        if self.policy == "warn" and scale is None:
            self._accumulate(names, is_after, counts)
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
        self.nonfinite += _raw_total(values, is_after)
        return self._act(_where(names, values), scale)

    def _act(self, where: str, scale: float | None) -> bool:
        at = f" at step {self.steps}"
        if scale is not None and scale > 1:  # fp16 overflow: GradScaler's routine
            self.skipped += 1
            return True
        if self.policy == "raise":
            raise NonFiniteError(
                f"trainer.nonfinite=raise: non-finite gradient{at} in {where}; "
                "use trainer.nonfinite=skip to skip such steps",
                self.steps,
            )
        self.skipped += 1
        if self.policy == "warn":
            log.warning("non-finite gradient%s in %s (fp16: step skipped by GradScaler)", at, where)
        elif self.skipped <= 10 or self.skipped % 100 == 0:
            log.warning(
                "skipped optimizer step%s: non-finite gradient in %s (%d skipped so far)", at, where, self.skipped
            )
        return True

    def _accumulate(self, names: list[str], is_after: list[bool], counts: Tensor) -> None:
        if self._pending is not None and self._pending.names != names:
            self.flush()
        if self._pending is None:
            self._pending = _Pending(names, is_after)
        self._pending.add(counts)

    def flush(self) -> None:
        """``warn``: read the pending counts (one host sync) and warn about them."""
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        values, steps = pending.read()
        if not steps:
            return
        self.bad_steps += steps
        self.nonfinite += _raw_total(values, pending.is_after)
        log.warning(
            "non-finite gradients in %d step(s), stepped anyway (trainer.nonfinite=warn): %s",
            steps,
            _where(pending.names, values),
        )

    def state_dict(self) -> dict:
        self.flush()
        return {"skipped": self.skipped, "bad_steps": self.bad_steps, "nonfinite": self.nonfinite, "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.skipped, self.bad_steps, self.nonfinite = state["skipped"], state["bad_steps"], state["nonfinite"]
        self.steps = state["steps"]


class _Pending:
    """``warn``: per-step count vectors kept on the device (no op per step), folded every
    ``FOLD_AT`` steps into totals and a count of steps with any non-finite entry."""

    def __init__(self, names: list[str], is_after: list[bool]):
        self.names, self.is_after = names, is_after
        self.rows: list[Tensor] = []
        self.folded: Tensor | None = None  # [totals..., bad steps], float64

    def add(self, counts: Tensor) -> None:
        self.rows.append(counts)
        if len(self.rows) >= FOLD_AT:
            self.folded, self.rows = self._fold(), []

    def _fold(self) -> Tensor:
        m = torch.stack(self.rows).double()
        row = torch.cat([m.sum(0), (m.amax(1) > 0).sum().double().reshape(1)])
        return row if self.folded is None else self.folded + row

    def read(self) -> tuple[list[float], int]:
        """(total per name, steps with any non-finite entry): one host read."""
        host = self._fold().tolist() if self.rows else self.folded.tolist()
        return host[:-1], int(host[-1])


def _raw_total(values: list[float], is_after: list[bool]) -> int:
    """Non-finite raw entries: the after-transform counts re-count transformed tensors."""
    return int(sum(v for v, after in zip(values, is_after) if not after))


def _where(names: list[str], values: list[float]) -> str:
    bad = [f"{n} ({int(v)})" for n, v in zip(names, values) if v]
    more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
    return ", ".join(bad[:5]) + more
