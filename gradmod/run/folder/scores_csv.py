"""``scores.csv``: each training example's GraNd and EL2N, one row per example and epoch (its
columns: ``gradmod.hooks.score_columns``), from a per_sample rule with ``scores``.

At each epoch's end the stage's rows are taken (one host read), gathered from every rank
under DDP (each rank saw its share of the epoch), sorted by dataset index and appended.
Resumed, the rows of the epochs the checkpoint finished are kept (from the run folder, or
from the checkpoint's when the run resumes into a new one) and later ones dropped (they
are trained again); the rows of an epoch in progress travel in the checkpoint with the
hooks' state.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gradmod.hooks.score_columns import COLUMNS, EL2N, GRAND, HEADERS, INDEX, LABEL, SCORES_FILE
from gradmod.reporting.loggers import names_file
from gradmod.run.folder import atomic
from gradmod.training.callbacks import Callback


def gathered(rows: dict[str, torch.Tensor], world: int) -> dict[str, torch.Tensor]:
    """Every rank's rows on every rank (under DDP), sorted by dataset index (a stable sort:
    an index seen twice in an epoch keeps its order)."""
    if world > 1:
        parts: list[Any] = [None] * world
        dist.all_gather_object(parts, rows)
        rows = {k: torch.cat([p[k] for p in parts]) for k in rows}
    order = torch.sort(rows[INDEX], stable=True).indices
    return {k: v[order] for k, v in rows.items()}


def csv_lines(epoch: int, rows: dict[str, torch.Tensor]) -> str:
    columns = zip(*(rows[c].tolist() for c in (INDEX, LABEL, GRAND, EL2N)))
    return "".join(f"{epoch},{i},{y},{g:.10g},{e:.10g}\n" for i, y, g, e in columns)


class ScoresFile(Callback):
    """Appends each epoch's scores to ``<run>/scores.csv`` (``stage``: the per_sample stage
    keeping them; under DDP every rank gathers, and the ranks but 0 write into a folder of
    their own that is thrown away)."""

    def __init__(self, out: Path, stage: Any):
        self.path, self.stage = Path(out) / SCORES_FILE, stage

    def on_fit_start(self, trainer) -> None:
        kept = ""
        if trainer.resumed_from:  # the epochs the checkpoint finished, from this folder or the checkpoint's
            source = self.path if self.path.exists() else Path(trainer.resumed_from).parent.parent / SCORES_FILE
            kept = _rows_up_to(source, len(trainer.history)) if source.exists() else ""
        atomic.write_text(self.path, HEADERS[SCORES_FILE] + "\n" + kept)

    def on_epoch_end(self, trainer, record: dict[str, Any]) -> None:
        rows = gathered(self.stage.take_scores(), trainer.dist.world_size)
        with names_file(self.path), open(self.path, "a") as f:
            f.write(csv_lines(int(record["epoch"]), rows))


def _rows_up_to(path: Path, epoch: int) -> str:
    """The lines of ``scores.csv`` of epochs up to ``epoch`` (a line cut short is dropped)."""
    with names_file(path):
        lines = path.read_text().splitlines()[1:]
    return "".join(ln + "\n" for ln in lines if ln.count(",") == len(COLUMNS[SCORES_FILE]) - 1 and _epoch(ln) <= epoch)


def _epoch(line: str) -> int:
    try:
        return int(line.split(",", 1)[0])
    except ValueError:
        return 1 << 62  # not a row: dropped
