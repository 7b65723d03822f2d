"""``gradmod influence RUN``: which training examples made a finished run's test predictions.

For the test examples asked (by index, or the ``hardest``: the highest test loss at the last
checkpoint), TracIn over the run's checkpoints (``gradmod.analysis.influence``) gives every
training example a score; the ``k`` highest (proponents) and ``k`` lowest (opponents) of each go
into ``influence.csv`` (``test_index, train_index, label, score``, highest score first within a
test example; written first) and ``influence.png`` (where the examples are images). With
``projection=d`` the gradients are projected to ``d`` dimensions, and the projection is checked
against the exact scores on ``check`` training examples (Spearman over the top 100, relative
error), reported with the result. Bad input is a ``ValueError`` of one line, raised before
anything is written; a progress line per checkpoint, and now and then within one.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from gradmod.analysis.influence import chosen, influence, projection_error
from gradmod.analysis.score_report import checkpoint_progress, heap_as_the_run, own_config
from gradmod.analysis.self_influence import (
    check_weights,
    predictions,
    read_checkpoint,
    run_checkpoints,
    run_data,
    run_model,
    warn_unended,
)
from gradmod.data import as_float
from gradmod.reporting.lens.influence_plot import plot_influence
from gradmod.reporting.score_plots import image_shaped
from gradmod.run.folder import atomic
from gradmod.run.setup import resolve_device

log = logging.getLogger("gradmod.influence")

CSV, PNG = "influence.csv", "influence.png"
HEADER = "test_index,train_index,label,score"


def check_options(
    test: list[int] | None, hardest: int, k: int, batch_size: int, projection: int | None, check: int
) -> None:
    for name, value in (("--hardest", hardest), ("--k", k), ("--batch-size", batch_size), ("--check", check)):
        if value < 1:
            raise ValueError(f"{name} {value}: must be >= 1")
    if projection is not None and projection < 1:
        raise ValueError(f"--projection {projection}: the projected dimension must be >= 1 (or leave it out: exact)")
    if test is not None and not test:
        raise ValueError("--test: give test indices, e.g. --test 3,17 (or leave it out for the --hardest)")


def influence_run(
    run: str | Path,
    *,
    test: list[int] | None = None,
    hardest: int = 8,
    k: int = 8,
    params: Any = "*",
    projection: int | None = None,
    check: int = 1000,
    data_dir: str | None = None,
    batch_size: int = 100,
    device: str = "auto",
    seed: int = 0,
) -> dict[str, Any]:
    """Score ``run``'s training examples on its test examples; returns what was written, the
    proponents and opponents, and, projected, the projection's error against exact."""
    check_options(test, hardest, k, batch_size, projection, check)
    run, where = Path(run), resolve_device(device)
    checkpoints, data, build = _read_run(run, data_dir, params, k)
    last = build()
    last.load_state_dict(checkpoints[-1].model)
    tests = _tests(data, test, hardest, last, where, batch_size)
    warn_unended(run, len(checkpoints))
    train, queried = (data.train_x, data.train_y), (data.test_x[tests], data.test_y[tests])
    how = "exact" if projection is None else f"projected to {projection} dimensions"
    log.info("influence (%s) of %d training examples on %d test examples over %d checkpoints of %s",
             how, len(train[1]), len(tests), len(checkpoints), run)  # fmt: skip
    progress = checkpoint_progress(checkpoints, len(train[1]), "influence", "training examples")
    kw = {"params": params, "seed": seed, "batch_size": batch_size, "device": where}
    scores = influence(build, checkpoints, train, queried, projection=projection, progress=progress, **kw)
    error = None if projection is None else _projection_check(build, checkpoints, train, queried, scores, check, kw)
    top = torch.topk(scores, k, dim=1).indices, torch.topk(-scores, k, dim=1).indices
    _write_csv(run, data, tests, scores, top)  # first: the result
    preds = predictions(last, queried[0], batch_size=batch_size, device=where).tolist()
    files = [CSV, *_figure(run, data, tests, preds, top, scores, k)]
    index = data.dataset_index()
    rows = [
        {"index": t, "label": int(data.test_y[t]), "prediction": p}
        | {"proponents": [int(index[i]) for i in top[0][row].tolist()]}
        | {"opponents": [int(index[i]) for i in top[1][row].tolist()]}
        for row, (t, p) in enumerate(zip(tests.tolist(), preds))
    ]
    return {
        "run": str(run),
        "checkpoints": [c.path.name for c in checkpoints],
        "tests": rows,
        "projection": error,
        "files": [str(run / f) for f in files],
    }


def _read_run(run: Path, data_dir: str | None, params: Any, k: int):
    """(checkpoints, data, model factory), each checked before the long part: every checkpoint
    verified and of the run's model, the data the run's, the globs matching, ``k`` in range."""
    read = [read_checkpoint(p) for p in run_checkpoints(run, "influence")]
    checkpoints, config = [c for c, _ in read], own_config(run, read)
    heap_as_the_run(config)
    data = run_data(config, run, data_dir)
    build = run_model(config, data)
    check_weights(build(), checkpoints, config["model"].get("_target_") or config["model"].get("name") or "?")
    chosen(build(), params)
    n = len(data.train_y)
    if 2 * k > n:
        raise ValueError(f"--k {k}: the training set has {n} examples; k proponents and k opponents need k <= {n // 2}")
    return checkpoints, data, build


def _write_csv(run: Path, data, tests, scores, top) -> None:
    """influence.csv: each test example's proponents (highest first), then its opponents (most harmful last)."""
    index, lines = data.dataset_index(), []
    for row, t in enumerate(tests.tolist()):
        picked = torch.cat([top[0][row], top[1][row].flip(0)])
        lines += [f"{t},{int(index[i])},{int(data.train_y[i])},{float(scores[row, i]):.10g}\n" for i in picked.tolist()]
    atomic.write_text(run / CSV, HEADER + "\n" + "".join(lines))


def _tests(data, test: list[int] | None, hardest: int, last, where, batch_size: int) -> torch.Tensor:
    """The test examples asked, checked against the test set, or its ``hardest``."""
    n = len(data.test_y)
    if test is not None:
        bad = [t for t in test if not 0 <= t < n]
        if bad:
            raise ValueError(f"--test {bad[0]}: out of range; the test set has {n} examples (indices 0 to {n - 1})")
        return torch.tensor(test, dtype=torch.long)
    last.to(where).eval()
    losses = []
    with torch.no_grad():
        for i in range(0, n, batch_size):
            x, y = as_float(data.test_x[i : i + batch_size].to(where)), data.test_y[i : i + batch_size].to(where)
            losses.append(F.cross_entropy(last(x), y, reduction="none").cpu())
    return torch.sort(torch.cat(losses), descending=True, stable=True).indices[: min(hardest, n)]


def _projection_check(build, checkpoints, train, queried, scores, check: int, kw: dict[str, Any]) -> dict[str, Any]:
    """The projected scores against exact ones on ``check`` training examples drawn with ``seed``."""
    n = len(train[1])
    some = torch.randperm(n, generator=torch.Generator().manual_seed(kw["seed"]))[: min(check, n)].sort().values
    log.info("projection check: exact scores of %d training examples", len(some))
    exact = influence(build, checkpoints, (train[0][some], train[1][some]), queried, **kw)
    error = projection_error(exact, scores[:, some]) | {"examples": len(some)}
    log.info(
        "projection against exact: Spearman over the top 100 %.3f (lowest of the test examples), mean %.3f; "
        "relative error %.3g",
        error["spearman_min"],
        error["spearman_mean"],
        error["relative_error"],
    )
    return error


def _figure(run: Path, data, tests, preds: list[int], top, scores, k: int) -> list[str]:
    """``influence.png`` where the examples are images, else one line saying it is not drawn."""
    if not image_shaped(data.train_x):
        log.info("influence.png not drawn: the examples are not images")
        return []
    titles = [
        f"test {t}: {int(data.test_y[t])}/{p}" + ("" if int(data.test_y[t]) == p else " x")
        for t, p in zip(tests.tolist(), preds)
    ]
    images, names = [], []
    for row in range(len(tests)):
        picked = torch.cat([top[0][row], top[1][row]])
        images.append(data.train_x[picked])
        names.append([f"{float(scores[row, i]):+.2g} ({int(data.train_y[i])})" for i in picked.tolist()])
    plot_influence(data.test_x[tests], titles, images, names, run / PNG, k=k)
    return [PNG]
