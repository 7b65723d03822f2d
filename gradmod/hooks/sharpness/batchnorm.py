"""The second pass runs at perturbed parameters: its batch statistics must not enter the
running statistics that evaluation uses.

During the second forward every normalisation layer that tracks running statistics in
training mode gets momentum 0 (davda54/sam's bypass), and afterwards its running mean,
variance and batch count are copied back from before: momentum 0 alone would still count
the batch (``num_batches_tracked``, which a ``momentum=None`` layer divides by) and would
turn the statistics into NaN where the perturbed forward overflowed (0 * inf).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase

STATS = ("running_mean", "running_var", "num_batches_tracked")


def _tracking(model: nn.Module) -> list[_NormBase]:
    return [m for m in model.modules() if isinstance(m, _NormBase) and m.track_running_stats and m.training]


@contextmanager
def running_stats_frozen(model: nn.Module) -> Iterator[None]:
    """Inside, forwards of ``model`` leave its normalisation layers' running statistics as they were."""
    layers = _tracking(model)
    if not layers:
        yield
        return
    saved = []
    with torch.no_grad():
        for m in layers:
            saved.append((m, m.momentum, [(name, b.clone()) for name in STATS if (b := getattr(m, name)) is not None]))
            m.momentum = 0.0
    try:
        yield
    finally:
        with torch.no_grad():
            for m, momentum, buffers in saved:
                m.momentum = momentum
                for name, copy in buffers:
                    getattr(m, name).copy_(copy)
