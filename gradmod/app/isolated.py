"""A sweep job's training in a child process of its own.

A job killed by a signal (the OOM killer's SIGKILL) must end only itself. Under Hydra's
joblib launcher the jobs run in a loky pool, which breaks as a whole when one of its worker
processes dies: the healthy jobs are lost and no report is written. So the launcher's
process (a loky worker, the basic launcher's own process, a submitit task) forks a child
that does the training and waits for it; the launcher never sees the child die.

``fork`` rather than a fresh interpreter: the child inherits the composed config and the
logging Hydra set up for the job (``train.log``), and does not import torch again. The
parent does no torch work of its own (no threads, no CUDA) before it forks.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import threading
import traceback
from typing import Any, Callable

ChildResult = tuple[int, "dict[str, Any] | None"]  # (exit status or -signal, what the child returned)


def run_forked(fn: Callable[[], ChildResult]) -> ChildResult:
    """Run ``fn`` in a forked child; returns its (exit code, summary), or (-signal, None)
    when a signal ended the child before it could answer."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: answer through the pipe, then leave without the parent's atexit work
        os.close(read_end)
        _child(fn, write_end)
    os.close(write_end)
    with _forward_signals(pid):
        with os.fdopen(read_end, "rb") as f:
            answer = f.read()
        _, status = _wait(pid)
    code = os.waitstatus_to_exitcode(status)
    try:
        sent_code, summary = json.loads(answer) if answer else (code, None)
    except ValueError:
        sent_code, summary = code, None
    return (code if code < 0 else sent_code), summary


def _child(fn: Callable[[], ChildResult], write_end: int) -> None:
    code = 1
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

    saved = {s: signal.signal(s, h) for s, h in ((signal.SIGTERM, forward), (signal.SIGINT, signal.SIG_IGN))}
    try:
        yield
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
