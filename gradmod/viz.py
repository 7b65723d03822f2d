"""Figures written into run folders (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_curves(history: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """Loss (train and test) and test accuracy per epoch, side by side."""
    epochs = [h["epoch"] for h in history]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
    ax_loss.plot(epochs, [h["train_loss"] for h in history], marker="o", label="train")
    ax_loss.plot(epochs, [h["test_loss"] for h in history], marker="o", label="test")
    ax_loss.set(xlabel="epoch", ylabel="cross-entropy loss", title="loss")
    ax_loss.legend()
    ax_acc.plot(epochs, [h["test_accuracy"] for h in history], marker="o", color="tab:green")
    ax_acc.set(xlabel="epoch", ylabel="accuracy", title="test accuracy")
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)


# --- gradient statistics and Grad-CAM (issue 7) ------------------------------------------

_LINESTYLE = {"pre": "-", "post": "--"}


def _series(rows: Sequence[tuple[int, dict[str, Any]]], field: str) -> dict[str, tuple[list, list]]:
    """key -> (steps, values) of one statistic over the reads that have it."""
    out: dict[str, tuple[list, list]] = {}
    for step, stats in rows:
        for key, s in stats.items():
            if field in s:
                xs, ys = out.setdefault(key, ([], []))
                xs.append(step)
                ys.append(s[field])
    return out


def _tensor_colors(keys) -> dict[str, Any]:
    tensors = list(dict.fromkeys(k.partition("/")[0] for k in keys))
    cmap = plt.get_cmap("tab10" if len(tensors) <= 10 else "tab20")
    return {t: cmap(i % cmap.N) for i, t in enumerate(tensors)}


def _finish(fig, ax, n_lines: int, path: str | Path) -> Path:
    if n_lines <= 16:
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)


def plot_grad_norms(rows: Sequence[tuple[int, dict[str, Any]]], path: str | Path) -> Path:
    """Per-tensor gradient L2 norm (mean over each read's window) against the step;
    one color per tensor, ``pre`` solid and ``post`` dashed. ``rows``: (step, stats) as
    ``HookSet.read_stats`` returns them."""
    series = _series(rows, "norm")
    colors = _tensor_colors(series)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for key, (xs, ys) in series.items():
        tensor, _, label = key.partition("/")
        ax.plot(xs, ys, _LINESTYLE.get(label, "-"), color=colors[tensor], label=key, marker="." if len(xs) < 3 else None)
    if series and all(y > 0 for _, ys in series.values() for y in ys):
        ax.set_yscale("log")
    ax.set(xlabel="optimizer step", ylabel="gradient L2 norm", title="gradient norm per tensor (pre solid, post dashed)")
    return _finish(fig, ax, len(series), path)


def plot_frac_clipped(rows: Sequence[tuple[int, dict[str, Any]]], path: str | Path) -> Path:
    """Per-tensor fraction of gradient elements the transforms between ``pre`` and
    ``post`` changed (for ``clamp``: clipped), against the step."""
    series = _series(rows, "frac_clipped")
    colors = _tensor_colors(series)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for key, (xs, ys) in series.items():
        tensor = key.partition("/")[0]
        ax.plot(xs, ys, color=colors[tensor], label=tensor, marker="." if len(xs) < 3 else None)
    ax.set_ylim(-0.02, 1.02)
    ax.set(xlabel="optimizer step", ylabel="fraction of elements", title="fraction clipped per tensor")
    return _finish(fig, ax, len(series), path)


def gradcam_overlay(images, cams, alpha: float = 0.5):
    """N x H x W grey images in [0, 1] and N x H x W Grad-CAM maps -> N x H x W x 3 RGB in
    [0, 1]: each map scaled to its own maximum, in the ``jet`` colormap over the image."""
    import numpy as np

    images = np.asarray(images, dtype=np.float32)
    cams = np.asarray(cams, dtype=np.float32)
    peak = cams.reshape(len(cams), -1).max(axis=1).reshape(-1, 1, 1)
    heat = plt.get_cmap("jet")(cams / np.where(peak > 0, peak, 1.0))[..., :3]
    return np.clip((1 - alpha) * images[..., None] + alpha * heat, 0.0, 1.0)


def plot_gradcam(images, cams, labels, preds, path: str | Path, title: str = "Grad-CAM") -> Path:
    """A row of Grad-CAM overlays titled with each digit's label and prediction."""
    overlay = gradcam_overlay(images, cams)
    n = len(overlay)
    cols = min(n, 8)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(1.6 * cols, 1.8 * rows + 0.4), squeeze=False)
    for i, ax in enumerate(axes.flat):
        ax.axis("off")
        if i < n:
            ax.imshow(overlay[i])
            ax.set_title(f"label {labels[i]} / pred {preds[i]}", fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)
