"""Optional speed-ups of the training step and the check that keeps it sync-free.

* ``channels_last``: conv weights in NHWC memory format; convolutions then run in that
  format (tensor cores on CUDA). Parameters stay the same objects, so hooks stay attached.
* ``compile_model``: ``torch.compile``. Parameter hooks still fire: they are pre-hooks of
  the parameters' ``AccumulateGrad`` nodes, which the eager autograd engine runs on the
  gradients the compiled backward returns. Module-output hooks are traced by Dynamo.
* ``SyncCheck``: on CUDA, ``torch.cuda.set_sync_debug_mode("error")`` between log points,
  so any step that makes the host wait for the GPU raises instead of silently slowing down.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn


def to_channels_last(model: nn.Module) -> nn.Module:
    """Convert 4-D parameters and buffers to channels_last, in place (same Parameter objects)."""
    return model.to(memory_format=torch.channels_last)


def compile_model(model: nn.Module, backend: str = "inductor") -> nn.Module:
    """``torch.compile(model)``; train the result, save ``model`` (its names have no prefix).

    Attach hooks to ``model`` before compiling: Dynamo guards on module hooks, so hooks
    added later only take effect after a recompile.
    """
    return torch.compile(model, backend=backend)


@contextmanager
def forbid_syncs(device: torch.device | str | None = None) -> Iterator[bool]:
    """Inside the block a CUDA host sync raises ``RuntimeError``; yields whether the
    check is live (False on a machine without CUDA or for a non-CUDA ``device``)."""
    live = torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda")
    if not live:
        yield False
        return
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield True
    finally:
        torch.cuda.set_sync_debug_mode(previous)


class SyncCheck:
    """The trainer's switch for ``trainer.sync_check``: ``forbid()`` after a step that
    the next one must not sync, ``allow()`` before reading statistics or ending an epoch."""

    def __init__(self, enabled: bool, device: torch.device):
        self.live = enabled and device.type == "cuda" and torch.cuda.is_available()

    def forbid(self) -> None:
        if self.live:
            torch.cuda.set_sync_debug_mode("error")

    def allow(self) -> None:
        if self.live:
            torch.cuda.set_sync_debug_mode("default")
