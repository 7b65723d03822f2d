"""A sweep job's training in a child process of its own.

A job killed by a signal (the OOM killer's SIGKILL) must end only itself. Under Hydra's
joblib launcher the jobs run in a loky pool, which breaks as a whole when one of its worker
processes dies: the healthy jobs are lost and no report is written; under the Optuna
sweeper the trials run in the sweeper's own process, which holds the study. So the
launcher's process (a loky worker, the basic launcher's own process, the sweeper's, a
submitit task, a Ray worker) starts a child that does the training and waits for it; the
launcher never sees the child die, and the child does not outlive it (``_die_with``).

``fork`` where it is safe: the child inherits the composed config and the logging Hydra set
up for the job (``train.log``), and does not import torch again. A fork is only safe while
the process has no native threads (OpenMP's pool, CUDA's): the launcher's process does no
torch work of its own, so under ``python train.py -m`` it has none. Where it has some (the
Optuna sweeper imports libraries that start thread pools; a sweep launched from a process
that already trained), the child is a fresh interpreter instead (``spawn``), handed the
job's function and arguments by pickle, which imports torch again (seconds) but cannot
deadlock.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import json
import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
import traceback
from typing import Any, Callable

ChildResult = tuple[int, "dict[str, Any] | None"]  # (exit status or -signal, what the child returned)


def run_isolated(target: Callable[..., ChildResult], args: tuple) -> ChildResult:
    """Run ``target(*args)`` in a child process; returns its (exit code, summary), or
    (-signal, None) when a signal ended the child before it could answer. A forked child
    where that is safe (``fork_is_safe``), else a fresh interpreter: ``target`` must be a
    module-level function and ``args`` picklable."""
    read_end, write_end = os.pipe()
    parent = os.getpid()
    if fork_is_safe():
        pid = os.fork()
        if pid == 0:  # the child: answer through the pipe, then leave without the parent's atexit work
            os.close(read_end)
            _die_with(parent)
            _child(lambda: target(*args), write_end)
        child = None
    else:
        child = _spawn(target, args, write_end)
        pid = child.pid
    os.close(write_end)
    with _forward_signals(pid):
        with os.fdopen(read_end, "rb") as f:
            answer = f.read()
        code = child.wait() if child is not None else os.waitstatus_to_exitcode(_wait(pid)[1])
    try:
        sent_code, summary = json.loads(answer) if answer else (code, None)
    except ValueError:
        sent_code, summary = code, None
    return (code if code < 0 else sent_code), summary


# A fresh interpreter's first line: the parent's import path (a test's or a script's own
# additions), then the job from the pickle that follows on stdin.
_BOOT = (
    "import json, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); sys.path[:] = json.loads(sys.stdin.buffer.readline()); "
    "from gradmod.app.isolated import _spawned; _spawned()"
)


def _spawn(target: Callable[..., ChildResult], args: tuple, write_end: int) -> subprocess.Popen:
    """A fresh Python running ``target(*args)``, its answer to ``write_end``; the console,
    the environment and the working folder are the parent's."""
    child = subprocess.Popen(
        [sys.executable, "-c", _BOOT, str(write_end), str(os.getpid())], stdin=subprocess.PIPE, pass_fds=(write_end,)
    )
    assert child.stdin is not None
    with child.stdin:
        child.stdin.write(json.dumps(sys.path).encode() + b"\n")
        child.stdin.write(pickle.dumps((sys.argv, target, args)))
    return child


def _spawned() -> None:
    """The fresh interpreter's side of ``_spawn``."""
    write_end = int(sys.argv[1])
    _die_with(int(sys.argv[2]))
    sys.argv, target, args = pickle.load(sys.stdin.buffer)
    _child(lambda: target(*args), write_end)


def _native_threads() -> set[int] | None:
    try:
        return {int(t) for t in os.listdir("/proc/self/task")}
    except OSError:  # no /proc (macOS, where fork is no safer)
        return None


# The threads this process had when gradmod.app was imported, with those that importing
# torch starts (``preload``); a native thread started since, and not Python's, is one of
# torch's pools.
_AT_IMPORT = _native_threads()


def preload(module: str) -> None:
    """Import ``module`` (the training code, and with it torch) here, so that each forked
    job inherits it instead of importing it again. The threads the import itself starts
    are no pool: they join the baseline, unless a thread had started unexplained before."""
    global _AT_IMPORT
    if module in sys.modules:
        return
    before = _native_threads()
    importlib.import_module(module)
    after = _native_threads()
    if None in (_AT_IMPORT, before, after) or _unexplained(before):
        return
    _AT_IMPORT = _AT_IMPORT | (after - before)


def _unexplained(now: set[int]) -> set[int]:
    return now - _AT_IMPORT - {t.native_id for t in threading.enumerate()}


def never_fork() -> None:
    """Spawn every job's child from this process: it runs threads of its own that started
    before gradmod was imported (a Ray worker's), which the check below cannot see."""
    global _AT_IMPORT
    _AT_IMPORT = None


def fork_is_safe() -> bool:
    """Whether this process may fork a child that runs torch: no native thread started since
    import but Python's own (a forked child inherits none of them, and OpenMP's pool in it
    waits forever)."""
    now = _native_threads()
    if now is None or _AT_IMPORT is None:
        return False
    return not _unexplained(now)


def _die_with(parent: int) -> None:
    """SIGKILL to this child when ``parent``, the launcher's process that waits for it, dies
    (a submitit job process or a Ray worker killed): its training ends with it, as that
    process's own would, instead of going on unreported after the sweep (Ray, besides, sends
    its own signals to a dead worker's children). Linux only (prctl)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux
        return
    if os.getppid() != parent:  # it died before the call
        os.kill(os.getpid(), signal.SIGKILL)


def _child(fn: Callable[[], ChildResult], write_end: int) -> None:
    code = 1
    for s in (
        signal.SIGINT,
        signal.SIGTERM,
        signal.SIGHUP,
    ):  # not the sweep's handlers: until the run installs its own,
        signal.signal(s, signal.SIG_DFL)  # a signal ends the job, which the parent reports as interrupted
    try:
        code, summary = fn()
        with os.fdopen(write_end, "w") as f:
            json.dump([code, summary], f)
    except BaseException:  # a bug in the job itself: its traceback goes where the job's stderr goes
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
            logging.shutdown()
        os._exit(code)


def _wait(pid: int) -> tuple[int, int]:
    while True:
        try:
            return os.waitpid(pid, 0)
        except InterruptedError:  # pragma: no cover (Python retries by itself since 3.5)
            continue


@contextlib.contextmanager
def _forward_signals(pid: int):
    """While the child runs: SIGTERM to this process goes on to the child (a scheduler ending
    the job), and SIGINT is left to the child, which gets the terminal's Ctrl-C itself and
    ends as ``interrupted`` with its checkpoint; the parent then reports that ending."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def forward(signum, frame):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)

    saved = {
        s: signal.signal(s, h)
        for s, h in ((signal.SIGTERM, forward), (signal.SIGHUP, forward), (signal.SIGINT, signal.SIG_IGN))
    }
    try:
        yield
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
