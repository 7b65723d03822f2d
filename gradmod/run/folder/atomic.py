"""One way to write a run file: whole or not at all.

The data goes to a temporary file beside ``path`` (``.<name>.<pid>.tmp``), is flushed and
fsynced, then renamed over ``path`` (``os.replace`` is atomic) and the folder fsynced, so
a reader or a crash sees the old file or the new one, never half of one. A failed write
removes its temporary file and raises an ``OSError`` naming ``path``.

A file a run keeps open and appends to (``metrics.jsonl``, ``train.log``) is first made a
file of its own with ``fresh``: a new file renamed over the old one, so that a hard link
to the old one elsewhere (a ``cp -al`` backup of the folder) keeps what it held.
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


def fresh(path: str | Path, keep: bool = False) -> Path:
    """``path`` replaced by rename with a new file, empty or (``keep``) holding its old bytes;
    returns ``path`` for ``open(..., "a")``. A failed copy raises an ``OSError`` naming ``path``."""
    path = Path(path)
    old = b""
    if keep:
        try:
            old = path.read_bytes()
        except FileNotFoundError:
            pass
        except OSError as e:
            raise OSError(e.errno, e.strerror or str(e), str(path)) from None
    write_bytes(path, old)
    return path


def write_text(path: str | Path, text: str) -> None:
    write_bytes(path, text.encode("utf-8"))
