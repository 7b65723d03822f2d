"""``gradmod scores RUN``: a finished run's TracIn self-influence, written into its folder.

``self_influence.csv`` (index, label, score: ``gradmod.hooks.score_columns``; highest score
first; written first), ``hardest.png`` (the ``top`` highest-scoring training images with label
and the last checkpoint's prediction; where the examples are images, else one line says so),
``self_influence_hist.png`` and ``self_influence_by_class.png``. The computation is
``gradmod.analysis.self_influence``'s, with a progress line now and then (``gradmod.reporting.progress``);
bad input (not a run folder, a run still training, no checkpoints, one of another model, data that
is not the run's) is a ``ValueError`` of one line, raised before anything is written.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from gradmod.analysis.self_influence import (
    Checkpoint,
    check_weights,
    predictions,
    read_checkpoint,
    run_checkpoints,
    run_data,
    run_model,
    self_influence,
    warn_unended,
)
from gradmod.hooks.score_columns import HEADERS, SELF_INFLUENCE_FILE
from gradmod.reporting.progress import Progress, duration
from gradmod.reporting.score_plots import image_shaped, plot_hardest, plot_score_histogram, plot_scores_by_class
from gradmod.run import host_heap
from gradmod.run.folder import atomic
from gradmod.run.folder import checkpoint_file as ckpt
from gradmod.run.setup import resolve_device

log = logging.getLogger("gradmod.scores")


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
    checkpoints, config = [c for c, _ in read], own_config(run, read)
    heap_as_the_run(config)
    data = run_data(config, run, data_dir)
    build, where = run_model(config, data), resolve_device(device)
    check_weights(build(), checkpoints, config["model"].get("_target_") or config["model"].get("name") or "?")
    warn_unended(run, len(checkpoints))
    x, y = data.train_x, data.train_y
    log.info("self-influence of %d training examples over %d checkpoints of %s", len(y), len(checkpoints), run)
    scores = self_influence(
        build, checkpoints, x, y, batch_size=batch_size, device=where, progress=checkpoint_progress(checkpoints, len(y))
    )
    order = torch.sort(scores, descending=True, stable=True).indices
    index = data.dataset_index()  # a pruned run's examples by their index in the whole set
    lines = "".join(f"{int(index[i])},{int(y[i])},{float(scores[i]):.10g}\n" for i in order.tolist())
    atomic.write_text(run / SELF_INFLUENCE_FILE, HEADERS[SELF_INFLUENCE_FILE] + "\n" + lines)  # first: the result
    hardest = order[: min(top, len(order))]
    last = build()
    last.load_state_dict(checkpoints[-1].model)
    preds = predictions(last, x[hardest], batch_size=batch_size, device=where).tolist()
    files = [SELF_INFLUENCE_FILE, *_figures(run, x, y, scores, hardest, preds)]
    by_class = {int(c): float(scores[y.cpu() == c].mean()) for c in sorted(set(y.tolist()))}
    return {
        "run": str(run),
        "examples": len(y),
        "checkpoints": [c.path.name for c in checkpoints],
        "top": [{"index": int(index[i]), "label": int(y[i]), "prediction": p} for i, p in zip(hardest.tolist(), preds)],
        "mean_by_class": by_class,
        "files": [str(run / f) for f in files],
    }


def own_config(run: Path, read: list[tuple[Checkpoint, dict[str, Any]]]) -> dict[str, Any]:
    """The config of the newest checkpoint of the folder's own run (its ``.gradmod/run.json``),
    else of the newest: the model and data every checkpoint is scored with."""
    try:
        owner = json.loads((run / ".gradmod" / "run.json").read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        owner = None
    own = [config for c, config in read if owner is not None and ckpt.run_of(c.path) == owner]
    return own[-1] if own else read[-1][1]


def heap_as_the_run(config: dict[str, Any]) -> None:
    """The host heap as the run's trainer set it (``trainer.host_heap``, keep by default): each
    batch then reuses the memory of the one before instead of page-faulting afresh."""
    if (config.get("trainer") or {}).get("host_heap", "keep") == "keep":
        host_heap.keep()


def checkpoint_progress(
    checkpoints: list[Checkpoint], examples: int, what: str = "self-influence", unit: str = "examples"
):
    """The per-checkpoint lines, and a progress line now and then with what is left of all
    (``what``: the work, as the lines name it; ``unit``: what ``examples`` counts)."""
    n = len(checkpoints)
    progress = Progress(n * examples, unit)

    def tell(k: int, c: Checkpoint, done: int) -> None:
        if done == 0:
            left = progress.left(k * examples)
            more = f"; about {duration(left)} left" if left is not None else ""
            log.info("checkpoint %d/%d: %s (step %d, lr %g)%s", k + 1, n, c.path.name, c.step, c.lr, more)
            return
        line = progress.update(k * examples + done)
        if line is not None:
            log.info("%s: %s (checkpoint %d/%d)", what, line, k + 1, n)

    return tell


def _figures(run: Path, x, y, scores, hardest, preds: list[int]) -> list[str]:
    """The figures, after the CSV: ``hardest.png`` where the examples are images (else one line
    saying so), the histogram and the scores per class for any examples."""
    drawn = []
    if image_shaped(x):
        plot_hardest(x[hardest], y[hardest].tolist(), preds, scores[hardest].tolist(), run / "hardest.png")
        drawn.append("hardest.png")
    else:
        log.info(
            "hardest.png not drawn: the examples are not images (each is %s %s; images are C x H x W with 1 or "
            "3 channels, or H x W pixels)",
            "x".join(map(str, x.shape[1:])) or "a scalar",
            str(x.dtype).removeprefix("torch."),
        )
    plot_score_histogram(scores, run / "self_influence_hist.png")
    plot_scores_by_class(scores, y.cpu(), run / "self_influence_by_class.png")
    return [*drawn, "self_influence_hist.png", "self_influence_by_class.png"]
