"""Clipping thresholds taken from the history of gradient norms: ``autoclip`` and ``zclip``.

* ``autoclip`` (Seetharaman et al. 2020; the ``autoclip`` package's ``QuantileClip``): the
  threshold is the ``quantile`` of the last ``history`` norms before clipping, globally or
  per tensor; the first step has no history and clips nothing.
* ``zclip`` (Kumar et al. 2025; the ``zclip`` package): running mean and variance of the
  total norm (EMA factor ``alpha``) after ``warmup_steps`` steps that only gather it; a
  norm far above the mean is clipped (``percentile``: to ``mean + z_threshold * std``;
  ``zscore``: to ``mean + z_threshold * std / (z / z_threshold)`` times ``clip_factor``
  with ``adaptive_scaling``, or to the mean).

Both keep their history on the device (a ring buffer, running moments in float64): no
host sync per step, except ``zclip(on_spike="skip")``, whose answer the loop must read.
Their state is in ``HookSet.state_dict()``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from gradmod.hooks.fused.group import EPS, GroupTransform, total_norm
from gradmod.hooks.mesh import reductions as mesh
from gradmod.hooks.mesh.sharded import plain
from gradmod.hooks.validators import number, positive


def _move(t: Tensor | None, device: torch.device | None) -> Tensor | None:
    return t if t is None or device is None else t.to(device)


class AutoClip(GroupTransform):
    """Clip to the ``quantile`` of the last ``history`` norms (before clipping); with
    ``per_tensor`` each tensor against its own history, else the rule's total norm."""

    name = "autoclip"

    def __init__(self, quantile: float = 0.9, history: int = 1000, per_tensor: bool = False):
        super().__init__()
        self.quantile = number(self.name, "quantile", quantile)
        if not 0 <= self.quantile <= 1:
            raise ValueError(f"transform 'autoclip': quantile={quantile!r} must be in [0, 1]")
        if isinstance(history, bool) or not isinstance(history, int) or history < 1:
            raise ValueError(f"transform 'autoclip': history={history!r} must be an int >= 1 (norms kept)")
        if not isinstance(per_tensor, bool):
            raise ValueError(f"transform 'autoclip': per_tensor={per_tensor!r} must be true or false")
        self.history, self.per_tensor = history, per_tensor
        self.seen = 0  # norms recorded (host counter: how much of the ring is filled)
        self.ring: Tensor | None = None  # [history] or [tensors, history]

    def apply_(self, params: list[Tensor], grads: list[Tensor]) -> None:
        if self.per_tensor:
            # One norm per tensor as clip_grad_norm_ takes it for one tensor (the norm of its norm).
            norms = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))[:, None], dim=1)
        else:
            norms = total_norm(grads)
        norms = plain(norms)
        if self.ring is None:
            self.ring = norms.new_zeros((*norms.shape, self.history))
        if self.seen:
            filled = self.ring[..., : min(self.seen, self.history)]
            limit = torch.quantile(filled, self.quantile, dim=-1)  # order in the ring does not matter
            # as clip_grad_norm_ computes it (max_norm / t is t.reciprocal() * max_norm), for equal bits
            coef = ((norms + EPS).reciprocal() * limit).clamp(max=1.0)
            torch._foreach_mul_([mesh.local(g) for g in grads], list(coef.unbind(0)) if self.per_tensor else coef)
        else:
            coef = torch.ones_like(norms)  # no history yet: no threshold
        self.ring[..., self.seen % self.history] = norms
        self.seen += 1
        total = norms if not self.per_tensor else torch.linalg.vector_norm(norms)
        after = total if not self.per_tensor else torch.linalg.vector_norm(norms * coef)
        self.record.add(total, coef if not self.per_tensor else after / (total + EPS))

    def state_dict(self) -> dict[str, Any]:
        return {"seen": self.seen, "ring": self.ring}

    def load_state_dict(self, state: Mapping[str, Any], device: torch.device | None = None) -> None:
        self.seen, self.ring = int(state["seen"]), _move(state["ring"], device)


class ZClip(GroupTransform):
    """Clip spikes of the total L2 norm ``g`` against its running statistics. After
    ``warmup_steps`` calls that only gather ``g`` (clipped to ``max_grad_norm`` if set),
    mean and variance start from them; then a spike is clipped to a limit (``mode``
    ``percentile``: ``g > mean + z_threshold * std``, clipped to that; ``zscore``:
    ``z = (g - mean) / (std + 1e-6) > z_threshold``, clipped per ``clip_option``), never
    above ``max_grad_norm``. ``mean <- alpha * mean + (1 - alpha) * g'`` and ``var <- alpha
    * var + (1 - alpha) * (g' - mean)^2`` with the new mean and the limit ``g'`` of a spike
    (not at all with ``skip_update_on_spike``; non-finite norms leave them unchanged).
    ``on_spike="skip"``: ``HookSet.after_backward()`` answers True so the loop skips the step.
    """

    name = "zclip"
    ON_SPIKE, MODES, CLIP_OPTIONS = ("clip", "skip"), ("percentile", "zscore"), ("adaptive_scaling", "mean")

    def __init__(
        self,
        alpha: float = 0.97,
        z_threshold: float = 2.5,
        warmup_steps: int = 25,
        on_spike: str = "clip",
        mode: str = "percentile",
        clip_option: str = "adaptive_scaling",
        clip_factor: float = 1.0,
        max_grad_norm: float | None = None,
        skip_update_on_spike: bool = False,
    ):
        super().__init__()
        self.alpha = number(self.name, "alpha", alpha)
        if not 0 < self.alpha < 1:
            raise ValueError(f"transform 'zclip': alpha={alpha!r} must be in (0, 1)")
        self.z_threshold = positive(self.name, "z_threshold", z_threshold, allow_zero=False)
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 1:
            raise ValueError(f"transform 'zclip': warmup_steps={warmup_steps!r} must be an int >= 1")
        self.warmup_steps = warmup_steps
        for arg, value, allowed in (
            ("on_spike", on_spike, self.ON_SPIKE),
            ("mode", mode, self.MODES),
            ("clip_option", clip_option, self.CLIP_OPTIONS),
        ):
            if value not in allowed:
                raise ValueError(f"transform 'zclip': {arg}={value!r}; allowed: {', '.join(allowed)}")
        self.skip, self.mode, self.clip_option = on_spike == "skip", mode, clip_option
        self.clip_factor = positive(self.name, "clip_factor", clip_factor, allow_zero=False)
        self.max_grad_norm = (
            None if max_grad_norm is None else positive(self.name, "max_grad_norm", max_grad_norm, allow_zero=False)
        )
        if not isinstance(skip_update_on_spike, bool):
            raise ValueError(f"transform 'zclip': skip_update_on_spike={skip_update_on_spike!r} must be true or false")
        self.skip_update_on_spike = skip_update_on_spike
        self.steps = 0  # calls so far (host counter: no sync to know the phase)
        self.warm: Tensor | None = None  # the warm-up norms (float64)
        self.mean: Tensor | None = None
        self.var: Tensor | None = None

    def apply_(self, params: list[Tensor], grads: list[Tensor]) -> Tensor | None:
        norm = plain(total_norm(grads)).float()  # FSDP2: its running statistics stay plain tensors
        g = norm.double()
        self.steps += 1
        if self.steps <= self.warmup_steps:
            self._gather(g)
            coef = torch.ones_like(g)
            if self.max_grad_norm is not None:  # the warm-up clips to max_grad_norm only
                coef = self._coef(g, g)
                torch._foreach_mul_([mesh.local(g) for g in grads], coef.to(grads[0].dtype))
            self.record.add(norm, coef)
            return None
        assert self.mean is not None and self.var is not None
        std = self.var.sqrt()
        if self.mode == "percentile":
            limit = self.mean + self.z_threshold * std
            spike = g > limit
        else:
            z = (g - self.mean) / (std + EPS)
            spike = z > self.z_threshold
            if self.clip_option == "mean":
                limit = self.mean
            else:  # a larger outlier gets a tighter limit
                limit = (self.mean + self.z_threshold * std / (z / self.z_threshold)) * self.clip_factor
        adaptive = torch.where(spike, limit, g)
        coef = self._coef(g, adaptive)
        torch._foreach_mul_([mesh.local(g) for g in grads], coef.to(grads[0].dtype))  # each rank's pieces
        update = torch.isfinite(g) if not self.skip_update_on_spike else torch.isfinite(g) & ~spike
        self._update(adaptive, update)
        self.record.add(norm, coef)
        return spike if self.skip else None

    def _coef(self, g: Tensor, limit: Tensor) -> Tensor:
        """``limit / (g + 1e-6)`` where ``g`` exceeds the limit (capped by max_grad_norm), else 1."""
        if self.max_grad_norm is not None:
            limit = limit.clamp(max=self.max_grad_norm)
        return torch.where(g > limit, limit / (g + EPS), 1.0)

    def _gather(self, g: Tensor) -> None:
        if self.warm is None:
            self.warm = g.new_zeros(self.warmup_steps)
        self.warm[self.steps - 1] = g
        if self.steps == self.warmup_steps:
            finite = torch.isfinite(self.warm)
            n = finite.sum().clamp_min(1)
            values = torch.where(finite, self.warm, 0.0)
            self.mean = values.sum() / n
            self.var = torch.where(finite, (self.warm - self.mean) ** 2, 0.0).sum() / n
            self.warm = None

    def _update(self, g: Tensor, where: Tensor) -> None:
        """Running statistics from the (clipped) norm ``g`` where ``where`` holds."""
        assert self.mean is not None and self.var is not None
        mean = self.alpha * self.mean + (1 - self.alpha) * g
        var = self.alpha * self.var + (1 - self.alpha) * (g - mean) ** 2
        self.mean = torch.where(where, mean, self.mean)
        self.var = torch.where(where, var, self.var)

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "warm": self.warm, "mean": self.mean, "var": self.var}

    def load_state_dict(self, state: Mapping[str, Any], device: torch.device | None = None) -> None:
        self.steps = int(state["steps"])
        self.warm, self.mean, self.var = (_move(state.get(k), device) for k in ("warm", "mean", "var"))
