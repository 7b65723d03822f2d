"""Figures of per-example scores (``gradmod scores RUN``): the highest-scoring training images
with their labels and predictions, the scores' histogram, and the scores per class."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gradmod.reporting.plots import _save, plot_grid, plt


def image_shaped(x: Any) -> bool:
    """Examples that are images: ``N x C x H x W`` with 1 or 3 channels, or ``N x H x W`` pixels (uint8)."""
    if x.dim() == 4:
        return x.shape[1] in (1, 3) and min(x.shape[2:]) > 1
    return x.dim() == 3 and str(x.dtype) == "torch.uint8" and min(x.shape[1:]) > 1


def plot_hardest(images: Any, labels: list[int], preds: list[int], scores: list[float], path: str | Path) -> Path:
    """The images in the order given (highest score first), titled ``label/prediction``; colour
    ones (3 channels) in colour."""
    titles = [f"{y}/{p}" + ("" if y == p else " x") for y, p in zip(labels, preds)]
    return plot_grid(
        images,
        path,
        cols=min(8, len(titles)),
        titles=titles,
        title=f"{len(titles)} highest self-influence (label/prediction, x: wrong); scores {scores[0]:.3g} to {scores[-1]:.3g}",
    )


def plot_score_histogram(scores: Any, path: str | Path, *, what: str = "self-influence") -> Path:
    """Counts of the scores in 60 bins; a log count axis, so that the few high ones show."""
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.hist(scores.numpy(), bins=60, color="tab:blue")
    ax.set_yscale("log")
    ax.set_xlabel(what)
    ax.set_ylabel("training examples")
    ax.set_title(f"{what} of {len(scores)} training examples")
    fig.tight_layout()
    _save(fig, path, dpi=100)
    plt.close(fig)
    return Path(path)


def plot_scores_by_class(scores: Any, labels: Any, path: str | Path, *, what: str = "self-influence") -> Path:
    """One box per class (whiskers at the 5th and 95th percentiles, the rest as points)."""
    classes = sorted(set(labels.tolist()))
    fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(classes)), 3.5))
    groups = [scores[labels == c].numpy() for c in classes]
    ax.boxplot(groups, whis=(5, 95), flierprops={"markersize": 2, "alpha": 0.4})
    ax.set_xticks(range(1, len(classes) + 1), [str(c) for c in classes])
    ax.set_yscale("log")
    ax.set_xlabel("label")
    ax.set_ylabel(what)
    ax.set_title(f"{what} per class")
    fig.tight_layout()
    _save(fig, path, dpi=100)
    plt.close(fig)
    return Path(path)
