"""The C library's heap on the host: memory freed by tensors kept for the next ones.

glibc hands a freed block above its mmap threshold (128 KiB at first, raised to the largest
block freed) back to the system, and trims the heap's top once twice that is free; the next
step's tensors of the same sizes then page-fault afresh. On a CPU run of the MNIST CNN that
was about a third of the epoch (docs/performance.md, Options). ``keep`` fixes the threshold
at 32 MiB (the most glibc allows), trims only past 2 GB free and grows the heap 64 MiB at a
time: blocks up to 32 MiB come from a heap that stays mapped, and the process keeps the
memory of its peak step until it ends. Other C libraries (musl, macOS) are left as they are.
"""

from __future__ import annotations

import ctypes

HOST_HEAPS = ("keep", "release")
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3  # glibc's malloc.h
KEEP = ((M_MMAP_THRESHOLD, 32 << 20), (M_TRIM_THRESHOLD, 2_000_000_000), (M_TOP_PAD, 64 << 20))
kept = False  # whether this process's heap keeps freed memory (the setting is the process's too)


def keep() -> bool:
    """Set glibc's heap to keep freed memory; whether it took the settings (False: not glibc)."""
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return False
    if not hasattr(libc, "gnu_get_libc_version"):  # glibc's own symbol: musl's mallopt does nothing
        return False
    mallopt = libc.mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    global kept
    kept = all(mallopt(option, value) == 1 for option, value in KEEP)
    return kept
