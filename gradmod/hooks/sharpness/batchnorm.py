"""The second pass runs at perturbed parameters: its batch statistics must not enter the
running statistics that evaluation uses.

During the second forward a BatchNorm layer (``BatchNorm1d/2d/3d``, ``SyncBatchNorm``)
that tracks running statistics in training mode has ``track_running_stats`` off: it
normalises by the batch's own statistics, as in training, and writes nothing, neither
the statistics nor ``num_batches_tracked``. That is davda54/sam's bypass (momentum 0)
without its two flaws: momentum 0 still counts the batch (which a ``momentum=None``
layer divides by), and turns the statistics into NaN where the perturbed forward
overflowed (0 * inf); and it costs no copy. Other layers with running statistics
(``InstanceNorm`` with ``track_running_stats=True`` updates them whatever that flag says)
get momentum 0 and their statistics copied back afterwards.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm, _NormBase

STATS = ("running_mean", "running_var", "num_batches_tracked")


@contextmanager
def running_stats_frozen(model: nn.Module) -> Iterator[None]:
    """Inside, forwards of ``model`` leave its normalisation layers' running statistics as they were."""
    tracking = [m for m in model.modules() if isinstance(m, _NormBase) and m.track_running_stats and m.training]
    switched = [m for m in tracking if isinstance(m, _BatchNorm)]
    copied = []
    with torch.no_grad():
        for m in tracking:
            if not isinstance(m, _BatchNorm):
                copied.append((m, m.momentum, [(n, b.clone()) for n in STATS if (b := getattr(m, n)) is not None]))
                m.momentum = 0.0
    for m in switched:
        m.track_running_stats = False
    try:
        yield
    finally:
        for m in switched:
            m.track_running_stats = True
        with torch.no_grad():
            for m, momentum, buffers in copied:
                m.momentum = momentum
                for n, saved in buffers:
                    getattr(m, n).copy_(saved)
