"""Which rank of a multi-process run ended: every rank's host and process id, shared when
the process group starts (``note``), let a rank whose collective failed name the peer whose
process is gone (gloo itself says only "Connection closed by peer")."""

from __future__ import annotations

import os
import socket
import time

import torch.distributed as dist

_PEERS: list[tuple[str, int]] = []  # (host, pid) by rank, while this process is in a process group


class RankLost(RuntimeError):
    """A collective failed because another rank's process ended."""

    def __init__(self, ranks: list[int], error: BaseException):
        named = ", ".join(f"rank {r} (pid {_PEERS[r][1]})" for r in ranks)
        cause = " ".join(f"{type(error).__name__}: {error}".split())
        super().__init__(
            f"{named} ended during the run (killed by a signal, or it crashed: its own output says "
            f"which), so rank {dist.get_rank() if dist.is_initialized() else '?'} stopped too ({cause})"
        )
        self.ranks = ranks


def note() -> None:
    """Share this process's host and pid with every rank (after the process group starts)."""
    peers: list = [None] * dist.get_world_size()
    dist.all_gather_object(peers, (socket.gethostname(), os.getpid()))
    _PEERS[:] = peers


def forget() -> None:
    _PEERS.clear()


def peer_lost(error: BaseException, wait: float = 3.0) -> BaseException:
    """``error`` as a ``RankLost`` where a runtime error met a peer on this host whose process
    has ended (waiting up to ``wait`` seconds for a dying one); any other error as it is."""
    if not isinstance(error, RuntimeError) or isinstance(error, RankLost) or len(_PEERS) < 2:
        return error
    here = socket.gethostname()
    others = [r for r, (host, pid) in enumerate(_PEERS) if host == here and pid != os.getpid()]
    deadline = time.monotonic() + wait
    while True:
        gone = [r for r in others if _ended(_PEERS[r][1])]
        if gone or time.monotonic() > deadline:
            return RankLost(gone, error) if gone else error
        time.sleep(0.05)


def _ended(pid: int) -> bool:
    """Whether process ``pid`` has ended (gone, or a zombie its launcher has not reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False
