"""One way to write a run file: whole or not at all.

The data goes to a temporary file beside ``path`` (``.<name>.<pid>.tmp``), is flushed and
fsynced, then renamed over ``path`` (``os.replace`` is atomic) and the folder fsynced, so
a reader or a crash sees the old file or the new one, never half of one. A failed write
removes its temporary file and raises an ``OSError`` naming ``path``.
"""

from __future__ import annotations

import os
from pathlib import Path


def write_bytes(path: str | Path, data: bytes) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise OSError(e.errno, e.strerror or str(e), str(path)) from None
    fd = os.open(path.parent, os.O_RDONLY)  # make the rename itself durable
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text(path: str | Path, text: str) -> None:
    write_bytes(path, text.encode("utf-8"))
