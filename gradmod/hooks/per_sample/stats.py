"""The per_sample stage's transforms as configured: ``per_sample_clip`` and its record,
``log``'s per-example statistics. Both keep their buffers on the device and are read at
log points by ``HookSet.read_stats`` (keys ``<rule>/per_sample_clip`` and ``<rule>/log``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from gradmod.hooks.stats.buffer import StatBuffer
from gradmod.hooks.validators import positive


class SumBuffer(StatBuffer):
    """Rows summed over the buffer."""

    def _fold(self) -> Tensor:
        return torch.stack(self._rows).sum(0)


class ClipRecord(SumBuffer):
    """Per backward: examples whose norm exceeded ``max_norm``, examples, the sum and the
    largest of their (unclipped) norms."""

    def add_norms(self, norms: Tensor, max_norm: float) -> None:
        norms = norms.float()
        self.add(
            torch.stack(
                [(norms > max_norm).sum().float(), norms.new_tensor(float(norms.numel())), norms.sum(), norms.max()]
            )
        )

    def _fold(self) -> Tensor:
        rows = torch.stack(self._rows)
        out = rows.sum(0)
        out[3] = rows[:, 3].max()
        return out

    @staticmethod
    def summarize(calls: int, values: list[float], paired: bool = False) -> dict[str, Any]:
        clipped, examples = values[:2]
        out = {"frac_clipped": clipped / max(examples, 1.0), "examples": int(examples), "calls": calls}
        if len(values) >= 4:  # each example's gradient norm before clipping
            out.update(norm_mean=values[2] / max(examples, 1.0), norm_max=values[3])
        return out


class PerSampleClip:
    """``per_sample_clip(max_norm, noise_multiplier=0)``: flat clipping of each example's
    gradient over all the rule's parameters, sum, Gaussian noise of std
    ``noise_multiplier * max_norm`` once per step, divided by the batch size. Configured
    in a rule; the per_sample stage (``gradmod.hooks.per_sample``) does the work."""

    name = "per_sample_clip"

    def __init__(self, max_norm: float, noise_multiplier: float = 0.0):
        self.max_norm = positive(self.name, "max_norm", max_norm, allow_zero=False)
        self.noise_multiplier = positive(self.name, "noise_multiplier", noise_multiplier)
        self.record = ClipRecord()

    def __call__(self, grad: Tensor) -> None:
        raise TypeError(
            "'per_sample_clip' acts on each example's gradient: it runs at stage 'per_sample' "
            "(set up by attach), not on a batch gradient"
        )

    def add_noise(self, sums: list[Tensor], generator: torch.Generator | None) -> None:
        """``N(0, (sigma C)^2)`` added to each of the step's clipped sums."""
        std = self.noise_multiplier * self.max_norm
        if std > 0:
            for s in sums:
                s.add_(torch.randn(s.shape, generator=generator, device=s.device, dtype=s.dtype), alpha=std)


class PerSampleLog(SumBuffer):
    """``log`` at the per_sample stage. Per backward of B examples with unclipped
    per-example gradients g_i and their mean g: the norms' p50, p90 and max, and the two
    estimates of the gradient noise scale ``B_simple = tr(Sigma) / |G|^2`` (McCandlish et
    al. 2018): ``tr(Sigma) ~ (mean_i |g_i|^2 - |g|^2) B/(B-1)``, ``|G|^2 ~ (B |g|^2 -
    mean_i |g_i|^2)/(B-1)``. A buffer reports p50 and p90 averaged over its backward
    calls, the largest norm, each estimate averaged and ``b_simple`` as their ratio."""

    def add_norms(self, norms: Tensor, mean_sq: Tensor) -> None:
        """``norms``: [B] per-example norms; ``mean_sq``: |g|^2 of their mean gradient."""
        n = norms.numel()
        q = torch.quantile(norms.float(), norms.new_tensor([0.5, 0.9], dtype=torch.float32))
        sq = norms.float().square().mean()
        if n > 1:
            trace, signal, counted = (sq - mean_sq) * n / (n - 1), (n * mean_sq - sq) / (n - 1), 1.0
        else:  # one example says nothing about the spread
            trace = signal = sq * 0
            counted = 0.0
        self.add(torch.stack([q[0], q[1], norms.float().max(), trace, signal, sq.new_tensor(counted)]))

    def _fold(self) -> Tensor:
        rows = torch.stack(self._rows)
        out = rows.sum(0)
        out[2] = rows[:, 2].max()
        return out

    @staticmethod
    def summarize(calls: int, values: list[float], paired: bool = False) -> dict[str, Any]:
        p50, p90, top, trace, signal, counted = values[:6]
        out = {"p50": p50 / calls, "p90": p90 / calls, "max": top, "calls": calls}
        if counted:
            out.update(
                tr_sigma=trace / counted, g_sq=signal / counted, b_simple=trace / signal if signal else float("inf")
            )
        return out


def per_sample_log(label: str | None = None) -> PerSampleLog:
    """``log`` in a per_sample rule (``label`` is accepted for symmetry; the key is ``<rule>/log``)."""
    return PerSampleLog()


def record(rules: list, norms: dict[str, Tensor], means: dict) -> None:
    """Each rule's statistics of one backward: its clip's norms, its log's (with ``means``, the
    mean gradient of each logged parameter), its GraNd scores by dataset index."""
    for r in rules:
        if r.clip is not None:
            r.clip.record.add_norms(norms[r.name], r.clip.max_norm)
        if r.log is not None:
            sq = sum(means[p].to(norms[r.name].dtype).square().sum() for p in r.params if p in means)
            r.log.add_norms(norms[r.name], norms[r.name].new_tensor(0.0) + sq)
        if r.scores is not None:
            r.scores.add(norms[r.name])


def buffers(rules: list) -> list[tuple[str, Any]]:
    """(statistics key, buffer) of each rule's ``per_sample_clip`` and ``log``."""
    clips = [(f"{r.name}/per_sample_clip", r.clip.record if r.clip else None) for r in rules]
    logs = [(f"{r.name}/log", r.log) for r in rules]
    return [kv for pair in zip(clips, logs) for kv in pair if kv[1] is not None]
