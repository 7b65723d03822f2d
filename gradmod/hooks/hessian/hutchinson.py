"""The trace of a symmetric operator by Hutchinson's estimator: the mean of ``z . A z`` over
Rademacher probes ``z`` (entries +-1), with its standard error (the probes' spread over the
square root of their number: the estimate lies within about two of them of the trace)."""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch
from torch import Tensor

from gradmod.hooks.hessian.dots import dot


class Trace(NamedTuple):
    value: float
    standard_error: float


def hutchinson(matvec: Callable[[Tensor], Tensor], like: Tensor, probes: int, generator: torch.Generator) -> Trace:
    """``probes`` products with Rademacher vectors shaped as ``like``, drawn from ``generator``
    (on the host, so the device's random stream is left alone)."""
    samples = []
    for _ in range(probes):
        z = torch.randint(0, 2, (like.numel(),), generator=generator).to(like.dtype).mul_(2).sub_(1).to(like.device)
        samples.append(dot(z, matvec(z)))
    mean = sum(samples) / len(samples)
    if len(samples) < 2:
        return Trace(mean, math.nan)
    var = sum((s - mean) ** 2 for s in samples) / (len(samples) - 1)
    return Trace(mean, math.sqrt(var / len(samples)))
