"""A run owns its folder: a lock for the run's lifetime, no mixing with an earlier run,
and no write before every check has passed.

``RunFolder(out).claim(resume=..., start_over=...)`` takes ``<run>/.gradmod/lock``
(``fcntl.flock``: the kernel releases it however the process ends) and decides, without
writing, what the run will be (a ``Claim``): a new run, the folder's run continued (from
its newest checkpoint, or from an older one: a new timeline), or a fork of another run's
checkpoint into an empty folder. It refuses in one line what would mix two runs or lose
results, and a link among the files a run touches that leads out of the folder (a run
writes, moves and deletes only inside its own folder). ``commit(claim)``, called once the
run has also built and restored everything, makes the first writes: ``start_over``'s
removal, the abandoned timeline moved aside, ``.gradmod/run.json``, and ``summary.json``
saying ``running`` (with the ending it continues under ``previous``) until the run writes
its own ending (``gradmod.reporting.run_summary``). See docs/reference/robustness.md ("A finished
run is sealed").
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gradmod.hooks.score_columns import SCORES_FILE, SELF_INFLUENCE_FILE
from gradmod.reporting import json_text, run_summary
from gradmod.reporting.run_summary import in_use
from gradmod.run.folder import atomic
from gradmod.run.folder import checkpoint_file as ckpt

log = logging.getLogger(__name__)

# Removed by start_over (with every checkpoint and TensorBoard event file).
OUTPUTS = (
    "summary.json",
    "metrics.jsonl",
    "model.pt",
    "grad_stats.jsonl",
    "hook_plan.json",
    "metrics.csv",
    "grad_stats.csv",
    "curves.png",
    "grad_norms.png",
    "tasks.png",
    "frac_clipped.png",
    "gradcam.png",
    "curvature.csv",  # a curvature rule's
    "curvature.png",
    SCORES_FILE,  # a scores rule's; the rest: gradmod scores RUN's, of the run they came from
    SELF_INFLUENCE_FILE,
    "hardest.png",
    "self_influence_hist.png",
    "self_influence_by_class.png",
)
ABANDONED = "abandoned-"  # checkpoints/abandoned-<n>/: a timeline left by a resume from an older step
# What a run writes, moves or deletes in its folder (with what checkpoints/, tensorboard/, .gradmod/
# and .hydra/ hold): none of it may be a link that leads out of the folder.
WRITTEN = (*OUTPUTS, "checkpoints", "tensorboard", ".gradmod", ".hydra", "train.log")
INSIDE = ("checkpoints", "tensorboard", ".gradmod", ".hydra")
RESERVE = "reserve"  # .gradmod/reserve: room for the ending's summary.json on a disk that fills up
RESERVE_BYTES = 256 * 1024
HOLDER = "lock.pid"  # .gradmod/lock.pid: the pid of the process holding .gradmod/lock


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
    if not isinstance(s, dict):
        return True
    earlier = s.get("previous")  # a continuation that did not end: the run it continued trained
    return s.get("status") == "ok" or bool(s.get("steps")) or (isinstance(earlier, dict) and _ended_ok(earlier))


def _ended_ok(s: dict[str, Any]) -> bool:
    return s.get("status") == "ok" or bool(s.get("steps"))


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
    previous: dict[str, Any] | None = None  # the folder's ending this run continues (summary.json)
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
        self.previous: dict[str, Any] | None = None  # the ending this run continues, once it owns the folder
        self._lock = None
        self._holder_before: bytes | None = None  # lock.pid as the run found it

    def claim(self, *, resume: str | None, start_over: bool) -> Claim:
        """Lock the folder and decide what this run is; a ``ValueError`` where it may not run."""
        self._refuse_links()
        self._take_lock()
        try:
            return self._decide(resume, start_over)
        except BaseException:
            self.release()
            raise

    def _decide(self, resume: str | None, start_over: bool) -> Claim:
        earlier, (owner, damage) = has_results(self.out), self._read_run_record()
        if start_over:
            if resume is not None:
                raise ValueError(
                    f"trainer.start_over=true discards the folder's results and cannot be combined "
                    f"with trainer.resume={resume}; drop one of them"
                )
            return Claim(_new_id(), start_over=True)
        if resume is None:
            if earlier:
                raise ValueError(
                    f"run folder {self.out} holds an earlier run's results ({', '.join(earlier)}); resume it with "
                    "trainer.resume=auto, replace it with trainer.start_over=true, or choose another hydra.run.dir"
                )
            return Claim(_new_id())
        if resume == "auto":
            if owner is None and damage is not None:
                self._refuse_without_record(damage)
            found = ckpt.latest(self.checkpoints, owner)
            if found is None:
                return self._nothing_to_resume(earlier, owner)
        else:
            found = ckpt.find(resume, self.checkpoints)
        return self._resume(found, earlier, owner)

    def _nothing_to_resume(self, earlier: list[str], owner: str | None) -> Claim:
        if earlier:
            raise ValueError(
                f"trainer.resume=auto: no usable checkpoint of this folder's run{_named(owner)} in "
                f"{self.checkpoints} (its results are left as they are); trainer.start_over=true "
                "discards the folder's results and starts a new run"
            )
        log.warning(
            "trainer.resume=auto: no checkpoint in %s; starting fresh. To resume an earlier run, pass "
            "hydra.run.dir=<the earlier run folder>",
            self.checkpoints,
        )
        return Claim(_new_id())

    def _resume(self, found: tuple[Path, dict[str, Any]], earlier: list[str], owner: str | None) -> Claim:
        path, state = found
        theirs = ckpt.run_of(path)
        if theirs == owner and (owner is not None or earlier):
            later = [
                p
                for p in ckpt.checkpoints(self.checkpoints, owner)
                if ckpt.step_of(p) > int(state["step"]) and p.resolve() != path.resolve()
            ]
            return Claim(owner or _new_id(), found, abandon=later, previous=self._previous())
        if earlier:
            raise ValueError(
                f"trainer.resume={path}: the checkpoint belongs to run {theirs or '<unnamed>'}, but run "
                f"folder {self.out} belongs to run {owner or '<unnamed>'} and holds its results; resume "
                "that run's own checkpoints here, or fork this one into a new hydra.run.dir"
            )
        return Claim(_new_id(), found, parent={"run": theirs, "step": int(state["step"])})

    def commit(self, claim: Claim) -> None:
        """The run's first writes, after every check: from here the folder's files are its own."""
        if claim.start_over:
            self._remove_outputs()
        if claim.abandon:
            self._set_aside(claim.abandon, int(claim.found[1]["step"]))
        self.run_id, self.owned, self.previous = claim.run_id, True, claim.previous
        # Room the ending can free to write its summary when the disk fills up (endings.write);
        # a disk without that room already runs without it: the first write that fails is named.
        try:
            atomic.write_bytes(self.meta / RESERVE, b"\0" * RESERVE_BYTES)
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
        record = {"run_id": claim.run_id, "pid": os.getpid(), "parent": claim.parent}
        atomic.write_text(self.meta / "run.json", json.dumps(record) + "\n")
        atomic.write_text(self.out / "summary.json", json_text.dumps(running(claim), indent=2) + "\n")

    def release(self) -> None:
        if self.owned:
            (self.meta / RESERVE).unlink(missing_ok=True)
        if self._lock is not None:
            if not self.owned:  # refused: lock.pid as it was, written while the lock is still held
                self._restore_holder()
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
        # The lock file is never written (a hard link to it in a backup stays as it was): the
        # holder's pid goes into a file of its own, replaced by rename.
        f = open(path, "a")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            try:
                holder = (self.meta / HOLDER).read_text().strip() or "unknown"
            except OSError:
                holder = "unknown"
            raise ValueError(
                f"run folder {self.out} is in use by another run (pid {holder}, lock {path}); "
                "wait for it to end or choose another hydra.run.dir"
            ) from None
        self._lock = f
        try:
            self._holder_before = (self.meta / HOLDER).read_bytes()
        except FileNotFoundError:
            self._holder_before = None
        atomic.write_text(self.meta / HOLDER, f"{os.getpid()}\n")

    def _restore_holder(self) -> None:
        """A run that never owned the folder leaves lock.pid byte-identical (or absent, as found)."""
        path = self.meta / HOLDER
        with contextlib.suppress(OSError):  # a folder gone: nothing to leave as it was
            if self._holder_before is None:
                path.unlink(missing_ok=True)
            elif path.read_bytes() != self._holder_before:
                atomic.write_bytes(path, self._holder_before)

    def _read_run_record(self) -> tuple[str | None, str | None]:
        """(the folder's run id, None) or (None, what is wrong with its record: missing, unreadable)."""
        path = self.meta / "run.json"
        if not path.exists():
            return None, "is missing"
        try:
            run_id = json.loads(path.read_text())["run_id"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            return None, f"cannot be read as a run record ({type(e).__name__}: {' '.join(str(e).split())})"
        return (run_id, None) if isinstance(run_id, str) and run_id else (None, "names no run_id")

    def _refuse_without_record(self, damage: str) -> None:
        """resume=auto where the folder's checkpoints name runs but its run record is gone:
        which run they continue is unknown, so nothing is resumed (or written)."""
        runs = sorted({r for p in ckpt.checkpoints(self.checkpoints) if (r := ckpt.run_of(p))})
        if not runs:
            return  # no checkpoint that names a run: nothing to tell apart
        hint = f'write {{"run_id": "{runs[0]}"}} there if they are this folder\'s run; ' if len(runs) == 1 else ""
        raise ValueError(
            f"trainer.resume=auto: {self.meta / 'run.json'} {damage}, so it is unknown which run this "
            f"folder continues (its checkpoints are run {', '.join(runs)}'s): {hint}fork a checkpoint "
            "into a new hydra.run.dir with trainer.resume=<checkpoint>, or discard the folder's results "
            "with trainer.start_over=true"
        )

    def _previous(self) -> dict[str, Any] | None:
        """The folder's ending, for the continuation's summary (``running`` with no owner: killed)."""
        summary = run_summary.read(self.out, holding=True)
        if not isinstance(summary, dict):
            return None
        if summary.get("status") == "killed":
            log.warning(
                "run folder %s: its last run was killed while running (summary.json says running and no "
                "process holds the folder); continuing from its newest checkpoint",
                self.out,
            )
        return {k: v for k, v in summary.items() if k != "previous"}  # one ending back, not a chain

    def _refuse_links(self) -> None:
        """A run writes, moves and deletes only inside its own folder: a link among what it
        touches that leads out of the folder is refused before anything is written."""
        root = Path(os.path.realpath(self.out))
        names = [self.out / n for n in WRITTEN]
        names += [p for n in INSIDE if (self.out / n).is_dir() for p in sorted((self.out / n).iterdir())]
        for path in names:
            target = Path(os.path.realpath(path))  # a link loop too (realpath does not raise)
            if (path.is_symlink() or path.exists()) and not target.is_relative_to(root):
                raise ValueError(
                    f"run folder {self.out}: {path.relative_to(self.out)} is a link to "
                    f"{target}, outside the folder; a run writes, moves and deletes files only "
                    "in its own folder: replace the link with a folder or file of its own, or choose "
                    "another hydra.run.dir"
                )

    def _set_aside(self, later: list[Path], step: int) -> None:
        """A resume from an older step: the later checkpoints become an abandoned timeline."""
        n = 1 + max(
            (
                int(p.name[len(ABANDONED) :])
                for p in self.checkpoints.glob(ABANDONED + "*")
                if p.name[len(ABANDONED) :].isdigit()
            ),
            default=0,
        )
        aside = self.checkpoints / f"{ABANDONED}{n}"
        aside.mkdir()
        for path in later:
            path.replace(aside / path.name)
        log.warning(
            "resuming from step %d: this run's later checkpoints (steps %s) moved to %s; a new timeline starts here",
            step,
            ", ".join(str(ckpt.step_of(p)) for p in later),
            aside,
        )

    def _remove_outputs(self) -> None:
        """``trainer.start_over``: the earlier results, every checkpoint and TensorBoard event file;
        a file in checkpoints/ without a gradmod checkpoint's header is left where it is."""
        for name in OUTPUTS:
            (self.out / name).unlink(missing_ok=True)
        for path in ckpt.checkpoints(self.checkpoints):
            if ckpt.written_by_gradmod(path):  # a file of that name without the header is not ours
                path.unlink()
        for aside in self.checkpoints.glob(ABANDONED + "*"):
            if not aside.is_dir() or aside.is_symlink():
                continue
            for path in ckpt.checkpoints(aside):
                if ckpt.written_by_gradmod(path):
                    path.unlink()
            kept = sorted(p.name for p in aside.iterdir())
            if kept:
                log.warning("trainer.start_over: kept %s in %s (not written by gradmod)", ", ".join(kept[:5]), aside)
            else:
                aside.rmdir()
        for path in (self.out / "tensorboard").glob("events.out.tfevents.*"):
            path.unlink()


def running(claim: Claim) -> dict[str, Any]:
    """The summary of a run in progress (``gradmod.reporting.run_summary``)."""
    return {
        "status": "running",
        "run": claim.run_id,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": time.time(),
        "test_accuracy": None,
        "test_loss": None,
        **({"previous": claim.previous} if claim.previous is not None else {}),
    }


def _new_id() -> str:
    return uuid.uuid4().hex[:12]


def _named(run: str | None) -> str:
    return f" ({run})" if run else ""
