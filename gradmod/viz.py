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
