"""Checkpoints: written atomically, the newest k kept, broken ones skipped on resume.

A checkpoint is one file ``<run>/checkpoints/step-000000150.pt``: ``torch.save``'s zip
archive, whose comment (the file's last bytes) holds the SHA-256 of the archive as written
and the run's id. ``torch.load(path)`` reads it as any such file (tensors and plain values
only, so ``weights_only=True`` is enough); ``load`` also verifies the checksum. Files of the
first format (a header line before the archive) are still read. The archive holds the model, optimizer and GradScaler
states, the position in the data order (the epoch in progress, the batches done in it and
the batch-order generator's state at that epoch's start), the RNG states (python, numpy,
torch, CUDA), the run's history and counters, the config and the hook plan.

Writing goes through ``gradmod.run.folder.atomic`` (a temporary file renamed over the final
name), so a crash leaves either the old set of checkpoints or the new one, never a
half-written ``step-*.pt``; a write that fails (disk full, no permission) raises an
``OSError`` naming the checkpoint and leaves the earlier checkpoints untouched.

The comment also names the run that wrote the file (`` run=<id>``): pruning and
``resume=auto`` look only at the files of one run, ordered by the step in their name.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gradmod.run.folder import atomic

log = logging.getLogger(__name__)

MAGIC = b"gradmod-checkpoint v2 sha256="  # the zip archive's comment, at the file's end
HEADER = b"gradmod-checkpoint v1 sha256="  # the first format's header line (read, no longer written)
RUN_FIELD = b" run="
_EOCD = b"PK\x05\x06"  # the zip archive's end record: 22 bytes, then its comment
_EOCD_SIZE = 22
_TAIL = 1024  # the file's last bytes, which hold the comment
_STEP = re.compile(r"step-(\d+)\.pt")


class CheckpointError(ValueError):
    """A checkpoint file that is not complete or not a gradmod checkpoint."""


def step_of(path: Path) -> int:
    """The step in a checkpoint's file name (``step-000000150.pt`` -> 150)."""
    return int(_STEP.fullmatch(Path(path).name).group(1))


def _seal(data: bytes) -> tuple[bytes, bytes] | None:
    """(the archive's comment, the archive as ``torch.save`` wrote it) of a checkpoint's bytes
    (or of its last bytes, for the comment alone); None where no checkpoint comment ends it."""
    at = data.rfind(MAGIC, max(0, len(data) - _TAIL))
    end = at - _EOCD_SIZE
    if end < 0 or data[end : end + 4] != _EOCD or int.from_bytes(data[at - 2 : at], "little") != len(data) - at:
        return None
    return data[at:], data[: at - 2] + b"\0\0"


def _signed(archive: bytes, run: str | None) -> bytes:
    """``torch.save``'s archive with the checksum and the run as its comment."""
    if archive[-_EOCD_SIZE : -_EOCD_SIZE + 4] != _EOCD or archive[-2:] != b"\0\0":
        raise AssertionError("torch.save wrote no zip archive without a comment")
    comment = MAGIC + hashlib.sha256(archive).hexdigest().encode() + (RUN_FIELD + run.encode() if run else b"")
    return archive[:-2] + len(comment).to_bytes(2, "little") + comment


def _ends(path: Path) -> tuple[bytes, bytes]:
    """A file's first line (up to 256 bytes) and its last bytes; empty if unreadable."""
    try:
        with open(path, "rb") as f:
            head = f.readline(256)
            f.seek(max(0, f.seek(0, os.SEEK_END) - _TAIL))
            return head, f.read()
    except OSError:
        return b"", b""


def run_of(path: Path) -> str | None:
    """The run id a checkpoint names; None for files without one (or unreadable)."""
    head, tail = _ends(path)
    seal = _seal(tail)
    text = seal[0] if seal else head.rstrip(b"\n") if head.startswith(HEADER) else b""
    _, sep, run = text.partition(RUN_FIELD)
    return run.decode(errors="replace") if sep else None


def written_by_gradmod(path: Path) -> bool:
    """Whether ``path`` carries a gradmod checkpoint's comment (or the first format's header):
    a file of the same name written by anyone else does not."""
    head, tail = _ends(path)
    return head.startswith(HEADER) or _seal(tail) is not None


def checkpoints(folder: Path, run: str | None = None) -> list[Path]:
    """Checkpoint files in ``folder``, oldest first by step; with ``run``, only that run's."""
    found = [p for p in Path(folder).glob("step-*.pt") if _STEP.fullmatch(p.name)]
    if run is not None:
        found = [p for p in found if run_of(p) == run]
    return sorted(found, key=step_of)


def save(folder: Path, state: dict[str, Any], keep: int, run: str | None = None) -> Path:
    """Write ``state`` (with its ``step``) as the newest checkpoint of ``run``; keep that
    run's newest ``keep`` (other runs' files are never touched)."""
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OSError(e.errno, e.strerror, str(folder)) from None
    buf = io.BytesIO()
    torch.save(state, buf)
    path = folder / f"step-{int(state['step']):09d}.pt"
    atomic.write_bytes(path, _signed(buf.getvalue(), run))
    for old in checkpoints(folder, run)[:-keep]:
        old.unlink(missing_ok=True)
    for stale in folder.glob(".step-*.tmp"):  # left by a run killed mid-write
        if not stale.name.endswith(f".{os.getpid()}.tmp"):
            stale.unlink(missing_ok=True)
    return path


def load(path: str | Path) -> dict[str, Any]:
    """Read and verify a checkpoint; a ``CheckpointError`` when it is truncated or corrupt."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"checkpoint {path}: cannot read ({e.strerror})") from None
    if data.startswith(HEADER):  # the first format: a header line, then the archive
        comment, _, payload = data.partition(b"\n")
        prefix = HEADER
    elif (seal := _seal(data)) is not None:
        (comment, payload), prefix = seal, MAGIC
    else:
        raise CheckpointError(f"checkpoint {path}: truncated or corrupt, or not a gradmod checkpoint (no checksum)")
    if hashlib.sha256(payload).hexdigest().encode() != comment[len(prefix) :].partition(RUN_FIELD)[0]:
        raise CheckpointError(f"checkpoint {path}: truncated or corrupt (checksum mismatch)")
    try:
        return torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except Exception as e:  # the checksum matched, so this is an incompatible payload
        raise CheckpointError(f"checkpoint {path}: unreadable payload ({_reason(e)})") from None


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def _reason(error: Exception) -> str:
    """torch.load's error in a line, without its terminal colours or its advice to load with
    ``weights_only=False`` (which would run whatever code the file names)."""
    text = _ANSI.sub("", str(error))
    m = re.search(r"WeightsUnpickler error: (.*?)(?:\n|$)", text)
    if m:
        return f"it holds objects other than tensors and plain values: {m.group(1).strip()}"
    return " ".join(text.split())[:300]


def latest(folder: Path, run: str | None = None) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint (of ``run``, when given) in ``folder`` that verifies; broken
    ones (another run's aside) are skipped with a warning."""
    for path in reversed(checkpoints(folder)):
        owner = run_of(path)  # None: unreadable (a truncated file's comment is gone) or no run
        if run is not None and owner not in (run, None):
            continue  # another run's
        try:
            state = load(path)
        except CheckpointError as e:
            log.warning("skipping %s", e)
            continue
        if run is None or owner == run:
            return path, state
    return None


def find(resume: str | None, folder: Path, run: str | None = None) -> tuple[Path, dict[str, Any]] | None:
    """``trainer.resume``: None -> start fresh; ``auto`` -> the newest good checkpoint of
    ``run`` in ``folder`` (fresh, with a warning, when there is none); a path -> that file,
    which must verify."""
    if resume is None:
        return None
    if resume == "auto":
        found = latest(folder, run)
        if found is None:
            # Each run gets a new folder unless told otherwise, so this is usually a mistake.
            log.warning(
                "trainer.resume=auto: no complete checkpoint in %s; starting fresh. To resume an "
                "earlier run, pass hydra.run.dir=<the earlier run folder>",
                folder,
            )
        return found
    try:
        return Path(resume), load(resume)
    except CheckpointError as e:
        raise ValueError(f"trainer.resume={resume}: {e}") from None


def rng_state() -> dict[str, Any]:
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": [name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])
