"""A run owns its folder: a lock for the run's lifetime, no mixing with an earlier run,
and no write before every check has passed.

``RunFolder(out).claim(resume=..., start_over=...)`` takes ``<run>/.gradmod/lock``
(``fcntl.flock``: the kernel releases it however the process ends) and decides, without
writing, what the run will be (a ``Claim``): a new run, the folder's run continued (from
its newest checkpoint, or from an older one: a new timeline), or a fork of another run's
checkpoint into an empty folder. It refuses in one line what would mix two runs or lose
results. ``commit(claim)``, called once the run has also built and restored everything,
makes the first writes: ``start_over``'s removal, the abandoned timeline moved aside, and
``.gradmod/run.json``. See docs/reference/robustness.md ("A finished run is sealed").
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gradmod.run import atomic
from gradmod.run import checkpoint_file as ckpt

log = logging.getLogger(__name__)

# Removed by start_over (with every checkpoint and TensorBoard event file).
OUTPUTS = ("summary.json", "metrics.jsonl", "model.pt", "grad_stats.jsonl", "hook_plan.json", "metrics.csv",
           "grad_stats.csv", "curves.png", "grad_norms.png", "frac_clipped.png", "gradcam.png")
ABANDONED = "abandoned-"  # checkpoints/abandoned-<n>/: a timeline left by a resume from an older step


def has_results(out: str | Path) -> list[str]:
    """What in ``out`` an earlier run trained (relative names; [] when none). A summary of a
    run that stopped before its first step, or an empty ``metrics.jsonl``, is not a result."""
    out = Path(out)
    found = [name for name in ("model.pt", "metrics.jsonl") if _nonempty(out / name)]
    if (out / "summary.json").is_file() and _trained(out / "summary.json"):
        found.insert(0, "summary.json")
    if any((out / "checkpoints").rglob("step-*.pt")):
        found.append("checkpoints/")
    return found


def _nonempty(path: Path) -> bool:
    return path.is_file() and path.stat().st_size > 0


def _trained(summary: Path) -> bool:
    try:
        s = json.loads(summary.read_text())
    except (OSError, ValueError):
        return True  # unreadable: keep it, to be safe
    return not isinstance(s, dict) or s.get("status") == "ok" or bool(s.get("steps"))


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


@dataclass
class Claim:
    """What the run will be: its id, the checkpoint it restores (``found``), the run it
    forks (``parent``), and what ``commit`` changes in the folder."""

    run_id: str
    found: tuple[Path, dict[str, Any]] | None = None
    parent: dict[str, Any] | None = None
    start_over: bool = False
    abandon: list[Path] = field(default_factory=list)  # this run's checkpoints after the one resumed


class RunFolder:
    """The run folder ``out`` as held by this process (see the module notes)."""

    def __init__(self, out: str | Path):
        self.out = Path(out)
        self.meta = self.out / ".gradmod"
        self.checkpoints = self.out / "checkpoints"
        self.run_id: str | None = None
        self.owned = False
        self._lock = None

    def claim(self, *, resume: str | None, start_over: bool) -> Claim:
        """Lock the folder and decide what this run is; a ``ValueError`` where it may not run."""
        self._take_lock()
        try:
            return self._decide(resume, start_over)
        except BaseException:
            self.release()
            raise

    def _decide(self, resume: str | None, start_over: bool) -> Claim:
        earlier, owner = has_results(self.out), self._read_run_id()
        if start_over:
            if resume is not None:
                raise ValueError(f"trainer.start_over=true discards the folder's results and cannot be combined "
                                 f"with trainer.resume={resume}; drop one of them")
            return Claim(_new_id(), start_over=True)
        if resume is None:
            if earlier:
                raise ValueError(
                    f"run folder {self.out} holds an earlier run's results ({', '.join(earlier)}); resume it with "
                    "trainer.resume=auto, replace it with trainer.start_over=true, or choose another hydra.run.dir")
            return Claim(_new_id())
        if resume == "auto":
            found = ckpt.latest(self.checkpoints, owner)
            if found is None:
                return self._nothing_to_resume(earlier, owner)
        else:
            found = ckpt.find(resume, self.checkpoints)
        return self._resume(found, earlier, owner)

    def _nothing_to_resume(self, earlier: list[str], owner: str | None) -> Claim:
        if earlier:
            raise ValueError(f"trainer.resume=auto: no usable checkpoint of this folder's run{_named(owner)} in "
                             f"{self.checkpoints} (its results are left as they are); trainer.start_over=true "
                             "discards the folder's results and starts a new run")
        log.warning("trainer.resume=auto: no checkpoint in %s; starting fresh. To resume an earlier run, pass "
                    "hydra.run.dir=<the earlier run folder>", self.checkpoints)
        return Claim(_new_id())

    def _resume(self, found: tuple[Path, dict[str, Any]], earlier: list[str], owner: str | None) -> Claim:
        path, state = found
        theirs = ckpt.run_of(path)
        if theirs == owner and (owner is not None or earlier):
            later = [p for p in ckpt.checkpoints(self.checkpoints, owner)
                     if ckpt.step_of(p) > int(state["step"]) and p.resolve() != path.resolve()]
            return Claim(owner or _new_id(), found, abandon=later)
        if earlier:
            raise ValueError(f"trainer.resume={path}: the checkpoint belongs to run {theirs or '<unnamed>'}, but run "
                             f"folder {self.out} belongs to run {owner or '<unnamed>'} and holds its results; resume "
                             "that run's own checkpoints here, or fork this one into a new hydra.run.dir")
        return Claim(_new_id(), found, parent={"run": theirs, "step": int(state["step"])})

    def commit(self, claim: Claim) -> None:
        """The run's first writes, after every check: from here the folder's files are its own."""
        if claim.start_over:
            self._remove_outputs()
        if claim.abandon:
            self._set_aside(claim.abandon, int(claim.found[1]["step"]))
        self.run_id, self.owned = claim.run_id, True
        record = {"run_id": claim.run_id, "pid": os.getpid(), "parent": claim.parent}
        atomic.write_text(self.meta / "run.json", json.dumps(record) + "\n")

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

    def _set_aside(self, later: list[Path], step: int) -> None:
        """A resume from an older step: the later checkpoints become an abandoned timeline."""
        n = 1 + max((int(p.name[len(ABANDONED):]) for p in self.checkpoints.glob(ABANDONED + "*")
                     if p.name[len(ABANDONED):].isdigit()), default=0)
        aside = self.checkpoints / f"{ABANDONED}{n}"
        aside.mkdir()
        for path in later:
            path.replace(aside / path.name)
        log.warning("resuming from step %d: this run's later checkpoints (steps %s) moved to %s; a new timeline "
                    "starts here", step, ", ".join(str(ckpt.step_of(p)) for p in later), aside)

    def _remove_outputs(self) -> None:
        """``trainer.start_over``: the earlier results, every checkpoint and TensorBoard event file."""
        for name in OUTPUTS:
            (self.out / name).unlink(missing_ok=True)
        for path in self.checkpoints.glob("step-*.pt"):
            path.unlink()
        for path in self.checkpoints.glob(ABANDONED + "*"):
            shutil.rmtree(path)
        for path in (self.out / "tensorboard").glob("events.out.tfevents.*"):
            path.unlink()


def _new_id() -> str:
    return uuid.uuid4().hex[:12]


def _named(run: str | None) -> str:
    return f" ({run})" if run else ""
