"""What a stage that runs a second forward and backward at moved parameters needs (sharpness,
a penalty's finite difference): the parameters' copies to move them back (``Copies``), ``.grad``
set aside while a backward writes a gradient that must stand alone (``set_aside``,
``accumulate``), and the running statistics kept out of it.

The second pass runs at perturbed parameters: its batch statistics must not enter the
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
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm, _NormBase
from torch.utils.weak import WeakIdKeyDictionary

STATS = ("running_mean", "running_var", "num_batches_tracked")


class Copies:
    """Parameters copied, before they move, into buffers kept from step to step: a fresh copy each
    step would cost its allocation and page faults, as much again as the copy itself."""

    def __init__(self) -> None:
        self._saved = WeakIdKeyDictionary()  # parameter -> its buffer

    def of(self, params: list[Tensor]) -> list[Tensor]:
        """``params``' values now, in their buffers."""
        out = []
        for p in params:
            buf = self._saved.get(p)
            if buf is None or buf.shape != p.shape or buf.dtype != p.dtype or buf.device != p.device:
                buf = self._saved[p] = torch.empty_like(p)
            out.append(buf)
        if out:
            torch._foreach_copy_(out, [p.detach() for p in params])
        return out


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


@contextmanager
def set_aside(params: list[Tensor]) -> Iterator[list[Tensor | None]]:
    """Inside, ``params`` have no ``.grad`` (a backward's gradient stands alone); on the way
    out each gets back the entry of the yielded list (what it held, unless ``accumulate``
    added to it), also when the body raised."""
    held = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        yield held
    finally:
        for p, g in zip(params, held):
            p.grad = g


def accumulate(params: list[Tensor], held: list[Tensor | None]) -> None:
    """Add each parameter's ``.grad`` (this backward's) into what ``set_aside`` held, as
    autograd accumulates: in place where something is held, else the new tensor itself."""
    for i, p in enumerate(params):
        g = p.grad
        if g is not None:
            h = held[i]
            held[i] = g if h is None else h.add_(g)
