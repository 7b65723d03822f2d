"""``curvature.csv`` and ``curvature.png``: a curvature rule's estimates in the run folder.

The CSV holds every estimate so far, one row per estimate and group (``step, lr, rule, group,
top1.., trace, trace_se, hvps, residual``), rewritten whole at each epoch's end (a resumed run's rows come
back with the callback's state); the picture (``gradmod.reporting.lens.curvature_plot``) is drawn at
the end."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gradmod.reporting.lens.curvature_plot import plot_curvature
from gradmod.reporting.loggers import names_file
from gradmod.run.folder import atomic
from gradmod.training.callbacks import Callback

CSV, PNG = "curvature.csv", "curvature.png"


def csv_text(rows: list[dict[str, Any]]) -> str:
    columns: list[str] = []
    for r in rows:
        columns += [k for k in r if k not in columns]
    lines = [",".join(columns)]
    lines += [
        ",".join("" if r.get(c) is None else f"{r[c]:.10g}" if isinstance(r[c], float) else str(r[c]) for c in columns)
        for r in rows
    ]
    return "\n".join(lines) + "\n"


class CurvatureFiles(Callback):
    """Writes ``estimates.rows`` (a ``gradmod.training.curvature.Curvature``) into ``out``."""

    def __init__(self, out: Path, estimates: Any):
        self.out, self.estimates = Path(out), estimates

    def on_epoch_end(self, trainer, record: dict[str, Any]) -> None:
        atomic.write_text(self.out / CSV, csv_text(self.estimates.rows))

    def on_fit_end(self, trainer) -> None:
        if self.estimates.rows:
            with names_file(self.out / PNG):
                plot_curvature(self.estimates.rows, self.out / PNG)
