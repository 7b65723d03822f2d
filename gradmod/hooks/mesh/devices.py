"""Where the hook core takes a device's own path, asked in one place.

Two properties of a device decide it: whether reading a value back to the host is free
(``reads_free``: the CPU, with no queue to wait for; ``reduce.stat_rows`` then looks for
non-finite entries only where a row says there are some), and whether a foreach op is a
loop of kernels anyway (``loops_foreach``: the CPU, where a big tensor's own in-place pass
beats two foreach passes, and kept scratch buffers beat fresh pages). On CUDA neither holds:
no read, one foreach launch for all tensors, the caching allocator.

``accelerator_paths()`` (or ``GRADMOD_ACCELERATOR_PATHS=1`` in the environment) makes CPU
tensors take the accelerator's paths, so that the CPU test suite runs them and compares
their bits with the CPU's own.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch

# Devices where reading one value back costs nothing (no queue to wait for).
READS_FREE = {"cpu"}
# Devices where a foreach op is a loop of per-tensor kernels (no single launch).
LOOPS_FOREACH = {"cpu"}
_ACCELERATOR_PATHS = [os.environ.get("GRADMOD_ACCELERATOR_PATHS") == "1"]


def reads_free(device: torch.device) -> bool:
    return device.type in READS_FREE and not _ACCELERATOR_PATHS[0]


def loops_foreach(device: torch.device) -> bool:
    return device.type in LOOPS_FOREACH and not _ACCELERATOR_PATHS[0]


@contextlib.contextmanager
def accelerator_paths(on: bool = True) -> Iterator[None]:
    """Within the block, every device takes the accelerator's paths (a test switch)."""
    saved = _ACCELERATOR_PATHS[0]
    _ACCELERATOR_PATHS[0] = on
    try:
        yield
    finally:
        _ACCELERATOR_PATHS[0] = saved
