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


# --- capture figures: feature maps, gradients, overlays (scripts/mnist_gradcam.py) -----


def plot_grid(images: Any, path: str | Path, *, cols: int = 8, cmap: str = "gray",
              titles: Sequence[str] | None = None, title: str | None = None) -> Path:
    """Images (N x H x W, or N x 1 x H x W) in rows of ``cols``, each on its own colour scale.

    Drawn as one mosaic on one axes: each tile is scaled to its own min..max, as a separate
    ``imshow`` would, but 32 axes would make saving the figure many times slower.
    """
    import numpy as np  # local: the top of this module is the curves' section

    tiles = [im.detach().float().cpu().reshape(im.shape[-2:]).numpy() for im in images]
    h, w = tiles[0].shape
    rows = -(-len(tiles) // cols)
    gap, top = max(1, h // 10), (h // 3 if titles is not None else max(1, h // 10))
    mosaic = np.full((rows * (h + top), cols * (w + gap)), np.nan)  # NaN: background
    for i, tile in enumerate(tiles):
        r, c = divmod(i, cols)
        span = tile.max() - tile.min()
        y, x = r * (h + top) + top, c * (w + gap)
        mosaic[y:y + h, x:x + w] = (tile - tile.min()) / span if span > 0 else 0.0
    scale = 1.6 / max(h, w)
    fig, ax = plt.subplots(figsize=(mosaic.shape[1] * scale, mosaic.shape[0] * scale + (0.5 if title else 0)))
    ax.imshow(mosaic, cmap=plt.get_cmap(cmap).with_extremes(bad="white"), vmin=0, vmax=1, interpolation="nearest")
    for i, text in enumerate(titles or []):
        r, c = divmod(i, cols)
        ax.text(c * (w + gap) + w / 2, r * (h + top) + top - 1, text, ha="center", va="bottom", fontsize=8)
    ax.axis("off")
    if title:
        ax.set_title(title)
    fig.savefig(path, dpi=80, bbox_inches="tight")
    plt.close(fig)
    return Path(path)


def plot_image(image: Any, path: str | Path, *, cmap: str | None = None, title: str | None = None) -> Path:
    """One H x W map (or 1 x H x W image) with a colour bar."""
    fig, ax = plt.subplots(figsize=(4, 4))
    shown = ax.imshow(image.detach().cpu().reshape(image.shape[-2:]).numpy(), cmap=cmap)
    fig.colorbar(shown, ax=ax, fraction=0.046)
    ax.axis("off")
    if title:
        ax.set_title(title)
    fig.savefig(path, dpi=80, bbox_inches="tight")
    plt.close(fig)
    return Path(path)
