"""Progress lines for long work (an epoch, TracIn over a checkpoint): a log line now and then,
so that a log file shows the work goes on and about when it ends, where a terminal's progress
bar is not seen.

``Progress(total, unit)`` is told how many units are done (``update``); at most once per
``every`` seconds (``EVERY``) it gives a line ``120/600 batches (20%), 1 min 12 s so far, about
4 min 48 s left``, and none for work that ends sooner (nor once all is done: the work's end says
so). The estimate is the rate since the first unit ended: the first often holds one-time work
(compilation, the per_sample stage's trace), so no estimate is given before a second.
"""

from __future__ import annotations

import time
from typing import Callable

EVERY = 30.0  # seconds between two lines, and before the first


def duration(seconds: float) -> str:
    """``8 s``, ``3 min 20 s``, ``2 h 5 min``."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s"
    return f"{s // 3600} h {s % 3600 // 60} min"


class Progress:
    """Units ``done`` of ``total`` from ``start`` (a resumed epoch starts part way)."""

    def __init__(
        self,
        total: int,
        unit: str,
        *,
        start: int = 0,
        every: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.total, self.unit, self.start, self.clock = total, unit, start, clock
        self.every = EVERY if every is None else every
        self.began = self.last = clock()
        self.first: tuple[int, float] | None = None  # (units done, time) when the first unit ended

    def update(self, done: int) -> str | None:
        """The line to log now, or None (too soon since the last one)."""
        now = self.clock()
        if self.first is None and done > self.start:
            self.first = (done, now)
        if now - self.last < self.every or done <= self.start or done >= self.total:
            return None  # (the work's own end says when it is done)
        self.last = now
        pct = f" ({100 * done / self.total:.0f}%)" if self.total else ""
        line = f"{done}/{self.total} {self.unit}{pct}, {duration(now - self.began)} so far"
        left = self.left(done, now)
        return line + (f", about {duration(left)} left" if left is not None else "")

    def left(self, done: int, now: float | None = None) -> float | None:
        """Seconds left at the rate since the first unit ended (None before a second one)."""
        if self.first is None or done <= self.first[0]:
            return None
        at, then = self.first
        now = self.clock() if now is None else now
        return (now - then) / (done - at) * max(self.total - done, 0)
