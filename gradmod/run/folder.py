"""A run owns its folder: a lock for the run's lifetime, and no mixing with an earlier run.

``RunFolder(out).claim(resume=..., start_over=...)``:

- takes ``<run>/.gradmod/lock`` (``fcntl.flock``, released by the kernel however the
  process ends, so a killed run leaves no stale lock) and writes its pid there; a second
  run into a locked folder is refused with one line naming the holder's pid;
- refuses a folder that holds an earlier run's results unless the run resumes it
  (``trainer.resume``) or starts over (``trainer.start_over=true``: the earlier results
  and checkpoints are removed first); nothing is written before this check passes;
- gives the run an id (``run.json``): a fresh run a new one, ``resume=auto`` the folder's,
  so checkpoints are pruned and found per run.

``<run>/.gradmod/hydra`` keeps a copy of the owning run's ``.hydra`` folder, so a run that
is refused can put back what Hydra wrote over it before the job started (``restore_kept``).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import uuid
from pathlib import Path

from gradmod.run import checkpoint_file as ckpt

# What a run writes: present at start, these mean the folder holds an earlier run.
RESULTS = ("summary.json", "metrics.jsonl", "model.pt")
# Removed by start_over (with checkpoints/step-*.pt); the logger's files are rewritten anyway.
OUTPUTS = (*RESULTS, "grad_stats.jsonl", "hook_plan.json", "metrics.csv", "grad_stats.csv", "curves.png",
           "grad_norms.png", "frac_clipped.png", "gradcam.png")
KEPT = ".hydra"  # the config folder Hydra writes before the job starts


def has_results(out: str | Path) -> list[str]:
    """The earlier run's result files in ``out`` (relative names; [] when none)."""
    out = Path(out)
    found = [name for name in RESULTS if (out / name).is_file()]
    if any((out / "checkpoints").glob("step-*.pt")):
        found.append("checkpoints/")
    return found


def in_use(out: str | Path) -> bool:
    """Whether a run holds the folder's lock now."""
    path = Path(out) / ".gradmod" / "lock"
    if not path.is_file():
        return False
    with open(path) as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
    return False


def may_write(out: str | Path) -> bool:
    """Whether a run that never owned ``out`` may leave its summary there: not over an
    earlier run's results, nor into a folder another run holds."""
    return not (has_results(out) or in_use(out))


def restore_kept(out: str | Path) -> None:
    """Put back the owning run's copy of ``.hydra`` (a refused run's Hydra overwrote it)."""
    copy = Path(out) / ".gradmod" / "hydra"
    if copy.is_dir():
        shutil.copytree(copy, Path(out) / KEPT, dirs_exist_ok=True)


class RunFolder:
    """The run folder ``out`` as owned by this process (see the module notes)."""

    def __init__(self, out: str | Path):
        self.out = Path(out)
        self.meta = self.out / ".gradmod"
        self.run_id: str | None = None
        self.resume_run: str | None = None  # whose checkpoints resume=auto looks at (None: any)
        self.owned = False
        self._lock = None

    def claim(self, *, resume: str | None, start_over: bool) -> str:
        """Lock the folder, check it may be used, and return this run's id."""
        self._take_lock()
        try:
            earlier = has_results(self.out)
            if earlier and resume is None and not start_over:
                raise ValueError(
                    f"run folder {self.out} holds an earlier run's results ({', '.join(earlier)}); resume it with "
                    "trainer.resume=auto, replace it with trainer.start_over=true, or choose another hydra.run.dir")
            previous = self._read_run_id()
            self.resume_run = previous
            if start_over:
                self.remove_outputs()
            self.run_id = self._continued(resume, previous) if not start_over else None
            self.run_id = self.run_id or uuid.uuid4().hex[:12]
        except BaseException:
            self.release()
            raise
        return self.run_id

    @staticmethod
    def _continued(resume: str | None, previous: str | None) -> str | None:
        """The id a resumed run carries on: the folder's (auto) or the checkpoint's (a path)."""
        if resume == "auto":
            return previous
        return ckpt.run_of(Path(resume)) if resume else None

    def take_ownership(self, run_id: str) -> None:
        """From here the run's files replace the folder's: record the run and keep its config."""
        self.run_id, self.owned = run_id, True
        replace_text(self.meta / "run.json", json.dumps({"run_id": run_id, "pid": os.getpid()}) + "\n")
        if (self.out / KEPT).is_dir():
            shutil.copytree(self.out / KEPT, self.meta / "hydra", dirs_exist_ok=True)

    def release(self) -> None:
        if self._lock is not None:
            fcntl.flock(self._lock, fcntl.LOCK_UN)
            self._lock.close()
            self._lock = None

    def _take_lock(self) -> None:
        for folder in (self.out, self.meta):
            try:
                folder.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise OSError(e.errno, f"cannot create the run folder ({e.strerror})", str(folder)) from None
        path = self.meta / "lock"
        f = open(path, "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "unknown"
            f.close()
            raise ValueError(f"run folder {self.out} is in use by another run (pid {holder}, lock {path}); "
                             "wait for it to end or choose another hydra.run.dir") from None
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
        self._lock = f

    def _read_run_id(self) -> str | None:
        try:
            return json.loads((self.meta / "run.json").read_text())["run_id"]
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def remove_outputs(self) -> None:
        for name in OUTPUTS:
            (self.out / name).unlink(missing_ok=True)
        for path in (self.out / "checkpoints").glob("step-*.pt"):
            path.unlink()


def replace_text(path: Path, text: str) -> None:
    """Write ``path`` through a temporary file, so a reader never sees it half-written."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
