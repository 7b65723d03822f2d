"""``influence.png``: each test example beside its most helpful and most harmful training
examples, one row per test example: the test image (``test i: label/prediction``), then its ``k``
proponents (``+score``, label), then its ``k`` opponents (``-score``, label)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch

from gradmod.reporting.plots import plot_grid


def plot_influence(
    test_images: Any,
    test_titles: Sequence[str],
    train_images: Any,
    train_titles: Sequence[Sequence[str]],
    path: str | Path,
    *,
    k: int,
) -> Path:
    """``train_images[t]``: the ``2k`` training images of test example ``t`` (proponents first),
    ``train_titles[t]`` their titles."""
    tiles, titles = [], []
    for t, (image, title) in enumerate(zip(test_images, test_titles)):
        tiles += [image, *train_images[t]]
        titles += [title, *train_titles[t]]
    return plot_grid(
        torch.stack([torch.as_tensor(i) for i in tiles]),
        path,
        cols=1 + 2 * k,
        titles=titles,
        title=f"each test example, then its {k} proponents (helped most) and {k} opponents (harmed most), TracIn",
    )
