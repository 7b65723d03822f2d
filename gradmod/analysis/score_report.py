"""``gradmod scores RUN``: a finished run's TracIn self-influence, written into its folder.

``self_influence.csv`` (index, label, score: ``gradmod.hooks.score_columns``; highest score
first), ``hardest.png`` (the ``top`` highest-scoring training images with label and the last
checkpoint's prediction), ``self_influence_hist.png`` and ``self_influence_by_class.png``. The
computation is ``gradmod.analysis.self_influence``'s; bad input (not a run folder, no checkpoints,
data that is not the run's) is a ``ValueError`` of one line, raised before anything is written.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from gradmod.analysis.self_influence import (
    predictions,
    read_checkpoint,
    run_checkpoints,
    run_data,
    run_model,
    self_influence,
)
from gradmod.hooks.score_columns import HEADERS, SELF_INFLUENCE_FILE
from gradmod.reporting.score_plots import plot_hardest, plot_score_histogram, plot_scores_by_class
from gradmod.run.folder import atomic
from gradmod.run.setup import resolve_device

log = logging.getLogger("gradmod.scores")

FILES = (SELF_INFLUENCE_FILE, "hardest.png", "self_influence_hist.png", "self_influence_by_class.png")


def score_run(
    run: str | Path, *, data_dir: str | None = None, batch_size: int = 100, top: int = 24, device: str = "auto"
) -> dict[str, Any]:
    """Score ``run``'s training examples over its checkpoints; returns what was written and the
    per-class means."""
    if batch_size < 1 or top < 1:
        raise ValueError(f"--batch-size {batch_size} and --top {top}: both must be >= 1")
    run = Path(run)
    paths = run_checkpoints(run)
    read = [read_checkpoint(p) for p in paths]  # every checkpoint verified before the long part
    checkpoints, config = [c for c, _ in read], read[-1][1]
    data = run_data(config, run, data_dir)
    build, where = run_model(config, data), resolve_device(device)
    x, y = data.train_x, data.train_y
    log.info("self-influence of %d training examples over %d checkpoints of %s", len(y), len(checkpoints), run)

    def progress(c) -> None:
        log.info("checkpoint %s (step %d, lr %g)", c.path.name, c.step, c.lr)

    scores = self_influence(build, checkpoints, x, y, batch_size=batch_size, device=where, progress=progress)
    order = torch.sort(scores, descending=True, stable=True).indices
    index = data.dataset_index()  # a pruned run's examples by their index in the whole set
    lines = "".join(f"{int(index[i])},{int(y[i])},{float(scores[i]):.10g}\n" for i in order.tolist())
    atomic.write_text(run / SELF_INFLUENCE_FILE, HEADERS[SELF_INFLUENCE_FILE] + "\n" + lines)
    hardest = order[: min(top, len(order))]
    last = build()
    last.load_state_dict(checkpoints[-1].model)
    preds = predictions(last, x[hardest], batch_size=batch_size, device=where).tolist()
    plot_hardest(x[hardest], y[hardest].tolist(), preds, scores[hardest].tolist(), run / "hardest.png")
    plot_score_histogram(scores, run / "self_influence_hist.png")
    plot_scores_by_class(scores, y.cpu(), run / "self_influence_by_class.png")
    by_class = {int(c): float(scores[y.cpu() == c].mean()) for c in sorted(set(y.tolist()))}
    return {
        "run": str(run),
        "examples": len(y),
        "checkpoints": [c.path.name for c in checkpoints],
        "top": [{"index": int(index[i]), "label": int(y[i]), "prediction": p} for i, p in zip(hardest.tolist(), preds)],
        "mean_by_class": by_class,
        "files": [str(run / f) for f in FILES],
    }
