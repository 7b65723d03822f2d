"""Figures written into run folders (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import math
import os
import textwrap
from pathlib import Path
from typing import Any, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402


def plot_curves(history: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """Loss (train and test) and the test metric per epoch (each task's, with several), side by side."""
    epochs = [h["epoch"] for h in history]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
    ax_loss.plot(epochs, [h["train_loss"] for h in history], marker="o", label="train")
    ax_loss.plot(epochs, [h["test_loss"] for h in history], marker="o", label="test")
    ax_loss.set(xlabel="epoch", ylabel="loss (summed over tasks)" if "tasks" in history[-1] else "loss", title="loss")
    ax_loss.legend()
    for name, values in _metric_series(history).items():
        ax_acc.plot(epochs, [math.nan if v is None else v for v in values], marker="o", label=name or None)
    ax_acc.set(xlabel="epoch", ylabel="test metric", title="test metric (accuracy for class labels)")
    if "tasks" in history[-1]:
        ax_acc.legend()
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # epochs are whole numbers
    fig.tight_layout()
    _save(fig, path, dpi=100)
    plt.close(fig)
    return Path(path)


def _save(fig, path: str | Path, **kwargs: Any) -> None:
    """``fig`` into a new file renamed over ``path``: a hard link to the old one elsewhere (a
    ``cp -al`` backup of the run folder) keeps its picture, and a reader never sees half a PNG."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fig.savefig(tmp, format=path.suffix.lstrip(".") or "png", **kwargs)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _metric_series(history: Sequence[dict[str, Any]]) -> dict[str, list[Any]]:
    """Task name -> its test metric per epoch ("" -> the single metric)."""
    if "tasks" in history[-1]:
        names = list(history[-1]["tasks"])
        return {k: [h.get("tasks", {}).get(k, {}).get("test_metric") for h in history] for k in names}
    return {"": [h.get("test_metric", h.get("test_accuracy")) for h in history]}


def plot_sweep_curves(
    rows: Sequence[dict[str, Any]], groups: Sequence[str], labels: Sequence[str], path: str | Path
) -> Path:
    """A sweep's jobs (``sweep_report`` rows, each with its ``curve``): test accuracy and test
    loss per epoch side by side, one colour per group (the seeds of a setting share it), a
    job that did not end ok dotted."""
    order = list(dict.fromkeys(groups))
    colors = plt.get_cmap("tab10" if len(order) <= 10 else "tab20").colors
    fig, (ax_acc, ax_loss) = plt.subplots(1, 2, figsize=(12, 4.5))
    drawn = set()
    for row, group in zip(rows, groups):
        if not row["curve"]:
            continue
        epochs = [c["epoch"] for c in row["curve"]]
        style = {
            "color": colors[order.index(group) % len(colors)],
            "marker": "o",
            "markersize": 3,
            "linestyle": "-" if row["status"] == "ok" else ":",
        }
        name = group if group not in drawn else None  # one legend entry per group
        drawn.add(group)
        ax_acc.plot(
            epochs,
            [math.nan if c["test_accuracy"] is None else c["test_accuracy"] for c in row["curve"]],
            label=name,
            **style,
        )
        ax_loss.plot(epochs, [c["test_loss"] for c in row["curve"]], **style)
    ax_acc.set(xlabel="epoch", ylabel="test accuracy", title=f"test accuracy, every job ({len(rows)})")
    ax_loss.set(xlabel="epoch", ylabel="test loss", title="test loss (dotted: did not end ok)")
    for ax in (ax_acc, ax_loss):
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if drawn:
        ax_acc.legend(fontsize="small", title="group (seeds share a colour)", loc="best")
    else:
        ax_acc.text(0.5, 0.5, "no job finished an epoch", ha="center", va="center", transform=ax_acc.transAxes)
    fig.tight_layout()
    _save(fig, path, dpi=100)
    plt.close(fig)
    return Path(path)


# --- capture figures: feature maps, gradients, overlays (scripts/mnist_gradcam.py) -----


def _save_image(fig, ax, path: str | Path, title: str | None) -> Path:
    """Save a figure of images: no axes, optional title, tight bounding box."""
    ax.axis("off")
    if title:
        ax.set_title(title)
    _save(fig, path, dpi=80, bbox_inches="tight")
    plt.close(fig)
    return Path(path)


def plot_grid(
    images: Any,
    path: str | Path,
    *,
    cols: int = 8,
    cmap: str = "gray",
    titles: Sequence[str] | None = None,
    title: str | None = None,
) -> Path:
    """Images (N x H x W, N x 1 x H x W, or N x 3 x H x W in colour) in rows of ``cols``, each on
    its own colour scale.

    Drawn as one mosaic on one axes: each tile is scaled to its own min..max, as a separate
    ``imshow`` would, but 32 axes would make saving the figure many times slower.
    """
    import numpy as np  # local: the top of this module is the curves' section

    tiles = [_tile(im) for im in images]  # H x W, or H x W x 3
    h, w = tiles[0].shape[:2]
    rows = -(-len(tiles) // cols)
    gap, top = max(1, h // 10), (h // 3 if titles is not None else max(1, h // 10))
    depth = (4,) if tiles[0].ndim == 3 else ()  # colour: RGBA, the background transparent
    mosaic = np.full((rows * (h + top), cols * (w + gap), *depth), 0.0 if depth else np.nan)  # NaN: background
    for i, tile in enumerate(tiles):
        r, c = divmod(i, cols)
        span = tile.max() - tile.min()
        y, x = r * (h + top) + top, c * (w + gap)
        scaled = (tile - tile.min()) / span if span > 0 else 0.0
        if depth:
            mosaic[y : y + h, x : x + w, :3], mosaic[y : y + h, x : x + w, 3] = scaled, 1.0
        else:
            mosaic[y : y + h, x : x + w] = scaled
    scale = 1.6 / max(h, w)
    fig, ax = plt.subplots(figsize=(mosaic.shape[1] * scale, mosaic.shape[0] * scale + (0.5 if title else 0)))
    ax.imshow(mosaic, cmap=plt.get_cmap(cmap).with_extremes(bad="white"), vmin=0, vmax=1, interpolation="nearest")
    for i, text in enumerate(titles or []):
        r, c = divmod(i, cols)
        ax.text(c * (w + gap) + w / 2, r * (h + top) + top - 1, text, ha="center", va="bottom", fontsize=8)
    return _save_image(fig, ax, path, title)


def _tile(im: Any) -> Any:
    """One image as a numpy array: H x W, or H x W x 3 for a colour one (3 x H x W)."""
    t = im.detach().float().cpu()
    return t.permute(1, 2, 0).numpy() if t.dim() == 3 and t.shape[0] == 3 else t.reshape(t.shape[-2:]).numpy()


def plot_image(image: Any, path: str | Path, *, cmap: str | None = None, title: str | None = None) -> Path:
    """One H x W map (or 1 x H x W image) with a colour bar."""
    fig, ax = plt.subplots(figsize=(4, 4))
    shown = ax.imshow(image.detach().cpu().reshape(image.shape[-2:]).numpy(), cmap=cmap)
    fig.colorbar(shown, ax=ax, fraction=0.046)
    return _save_image(fig, ax, path, title)


def plot_gradcam(
    images: Any,
    cams: Any,
    path: str | Path,
    *,
    cols: int = 8,
    titles: Sequence[str] | None = None,
    title: str | None = None,
) -> Path:
    """Images (N x 1 x H x W in [0, 1]) half and half with their maps (N x H x W, from
    `gradmod.capture.grad_cam`), each map divided by its maximum."""
    images, cams = images.detach().float().cpu(), cams.detach().float().cpu()
    peak = cams.amax(dim=(1, 2), keepdim=True).clamp_min(1e-12)  # an all-zero map stays zero
    blended = 0.5 * images.reshape(cams.shape) + 0.5 * cams / peak
    return plot_grid(blended, path, cols=cols, cmap="jet", titles=titles, title=title)


# --- gradient statistics over a run, Grad-CAM for TensorBoard (gradmod/observe.py) ------

_LINESTYLE = {"pre": "-", "post": "--"}


def _series(rows: Sequence[tuple[int, dict[str, Any]]], field: str) -> dict[str, tuple[list, list]]:
    """key -> (steps, values) of one statistic over the reads that have it; a non-finite value
    (written as null in the JSON files) is NaN, a gap in the line."""
    out: dict[str, tuple[list, list]] = {}
    for step, stats in rows:
        for key, s in stats.items():
            if field in s:
                xs, ys = out.setdefault(key, ([], []))
                xs.append(step)
                ys.append(math.nan if s[field] is None else s[field])
    return out


def _tensor_colors(keys) -> dict[str, Any]:
    tensors = list(dict.fromkeys(k.partition("/")[0] for k in keys))
    cmap = plt.get_cmap("tab10" if len(tensors) <= 10 else "tab20")
    return {t: cmap(i % cmap.N) for i, t in enumerate(tensors)}


def _rule_keys(rows: Sequence[tuple[int, dict[str, Any]]]) -> set[str]:
    """The keys of a group transform's records (``rule/transform``: one value per rule, not
    per tensor); they carry ``clip_coef``."""
    return {key for _, stats in rows for key, s in stats.items() if "clip_coef" in s}


def _rule_label(key: str) -> str:
    rule, _, transform = key.partition("/")
    return f"rule {rule} ({transform})"


def _panels(n: int):
    fig, axes = plt.subplots(n, 1, figsize=(9, 4.5 * n), squeeze=False)
    return fig, [a[0] for a in axes]


NORM_FIELDS = ("norm", "norm_mean", "norm_max", "p50", "p90")


def has_norms(rows: Sequence[tuple[int, dict[str, Any]]]) -> bool:
    """Whether ``plot_grad_norms`` has a line to draw (per_loss records have none of these)."""
    return any(f in s for _, stats in rows for s in stats.values() for f in NORM_FIELDS)


def _finish(fig, axes, path: str | Path) -> Path:
    for ax in axes:
        if ax.get_legend_handles_labels()[0] and len(ax.lines) <= 16:
            ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
        ax.grid(alpha=0.3)
    fig.tight_layout()
    if _wrap_titles(fig, axes):
        fig.tight_layout()
    _save(fig, path, dpi=100)
    plt.close(fig)
    return Path(path)


def _wrap_titles(fig, axes) -> bool:
    """Break a title wider than the figure (centred over an axes that a legend beside it
    narrows) into lines until it fits; whether any changed."""
    renderer, changed = fig.canvas.get_renderer(), False
    for ax in axes:
        text, width = ax.get_title(), 100
        while width > 20 and not _inside(ax.title.get_window_extent(renderer), fig.bbox):
            width -= 10
            ax.set_title(textwrap.fill(text, width))
            changed = True
    return changed


def _inside(box, bounds) -> bool:
    return box.x0 >= bounds.x0 and box.x1 <= bounds.x1


def plot_grad_norms(rows: Sequence[tuple[int, dict[str, Any]]], path: str | Path) -> Path:
    """Gradient L2 norms against the step: per tensor (mean over each read's window; one
    colour per tensor, ``pre`` solid and ``post`` dashed), and in a panel of its own each
    group transform's total norm over its rule's tensors, before clipping. ``rows``: (step,
    stats) as ``HookSet.read_stats`` returns them."""
    series, rules = _series(rows, "norm"), _rule_keys(rows)
    tensors = {k: v for k, v in series.items() if k not in rules}
    examples = {
        f"{k} ({f})": v
        for f in ("norm_mean", "norm_max", "p50", "p90")
        for k, v in _series(rows, f).items()
        if k.endswith(("/per_sample_clip", "/log"))
    }
    if examples and not tensors and not rules:  # per_sample rules: each example's norm, before clipping
        return _per_example_norms(examples, path)
    fig, axes = _panels(int(bool(tensors)) + int(bool(rules)) or 1)
    if tensors or not rules:
        ax, colors = axes[0], _tensor_colors(tensors)
        for key, (xs, ys) in tensors.items():
            tensor, _, label = key.partition("/")
            ax.plot(
                xs, ys, _LINESTYLE.get(label, "-"), color=colors[tensor], label=key, marker="." if len(xs) < 3 else None
            )
        paired = {k.partition("/")[2] for k in tensors} >= {"pre", "post"}
        ax.set(
            xlabel="optimizer step",
            ylabel="gradient L2 norm",
            title="gradient norm per tensor" + (" (pre solid, post dashed)" if paired else ""),
        )
    if rules:
        ax = axes[-1]
        for key in sorted(rules & series.keys()):
            xs, ys = series[key]
            ax.plot(xs, ys, label=_rule_label(key), marker="." if len(xs) < 3 else None)
        ax.set(
            xlabel="optimizer step",
            ylabel="total L2 norm, before clipping",
            title="total gradient norm per rule (all of a rule's tensors together)",
        )
    for ax in axes:
        values = [y for line in ax.lines for y in line.get_ydata() if not math.isnan(y)]
        if values and all(y > 0 for y in values):
            ax.set_yscale("log")
    return _finish(fig, axes, path)


def _per_example_norms(series: dict[str, tuple[list, list]], path: str | Path) -> Path:
    fig, axes = _panels(1)
    for key, (xs, ys) in sorted(series.items()):
        axes[0].plot(xs, ys, label=key, marker="." if len(xs) < 3 else None)
    axes[0].set(
        xlabel="optimizer step",
        ylabel="per-example gradient L2 norm",
        title="per_sample rules: each example's gradient norm before clipping (mean, max or quantiles)",
    )
    return _finish(fig, axes, path)


def plot_frac_clipped(rows: Sequence[tuple[int, dict[str, Any]]], path: str | Path) -> Path:
    """What the transforms changed, against the step, each panel saying what it counts: per
    tensor, the fraction of gradient elements the transforms between ``pre`` and ``post``
    changed (for ``clamp``: clipped; a smooth transform such as tanh changes nearly all);
    per rule, the fraction of a group transform's steps that clipped (clip_coef < 1)."""
    series, rules = _series(rows, "frac_clipped"), _rule_keys(rows)
    private = {k: v for k, v in series.items() if k.endswith("/per_sample_clip")}
    tensors = {k: v for k, v in series.items() if k not in rules and k not in private}
    rule_series = {k: v for k, v in series.items() if k in rules}
    if private and not tensors and not rule_series:
        fig, axes = _panels(1)
        for key, (xs, ys) in sorted(private.items()):
            axes[0].plot(xs, ys, label=key.partition("/")[0], marker="." if len(xs) < 3 else None)
        axes[0].set(
            xlabel="optimizer step",
            ylabel="fraction of examples clipped",
            ylim=(-0.02, 1.02),
            title="per_sample rules: fraction of examples whose gradient norm exceeded max_norm",
        )
        return _finish(fig, axes, path)
    fig, axes = _panels(int(bool(tensors)) + int(bool(rule_series)) or 1)
    if tensors:
        colors = _tensor_colors(tensors)
        for key, (xs, ys) in tensors.items():
            tensor = key.partition("/")[0]
            axes[0].plot(xs, ys, color=colors[tensor], label=tensor, marker="." if len(xs) < 3 else None)
        axes[0].set(
            xlabel="optimizer step",
            ylabel="fraction of elements changed",
            title="per tensor: fraction of gradient elements the transforms changed (clamp: clipped)",
        )
    if rule_series:
        for key, (xs, ys) in sorted(rule_series.items()):
            axes[-1].plot(xs, ys, label=_rule_label(key), marker="." if len(xs) < 3 else None)
        axes[-1].set(
            xlabel="optimizer step",
            ylabel="fraction of steps clipped",
            title="per rule: fraction of steps whose total norm was clipped (clip_coef < 1)",
        )
    for ax in axes:
        ax.set_ylim(-0.02, 1.02)
    return _finish(fig, axes, path)


def gradcam_overlay(images, cams, alpha: float = 0.5):
    """N x H x W grey images in [0, 1] and N x H x W Grad-CAM maps -> N x H x W x 3 RGB in
    [0, 1]: each map scaled to its own maximum, in the ``jet`` colormap over the image."""
    import numpy as np

    images = np.asarray(images, dtype=np.float32)
    cams = np.asarray(cams, dtype=np.float32)
    peak = cams.reshape(len(cams), -1).max(axis=1).reshape(-1, 1, 1)
    heat = plt.get_cmap("jet")(cams / np.where(peak > 0, peak, 1.0))[..., :3]
    return np.clip((1 - alpha) * images[..., None] + alpha * heat, 0.0, 1.0)


def plot_schedules(rows: Sequence[tuple[int, dict[str, Any]]], path: str | Path) -> Path:
    """The scheduled arguments' values in use (``rule/transform.arg``) and whether each
    window was open (``rule/active``, 1 or 0), at each log point, against the step."""
    series = _series(rows, "value")
    values = {k: v for k, v in series.items() if not k.endswith("/active")}
    windows = {k: v for k, v in series.items() if k.endswith("/active")}
    fig, axes = _panels(int(bool(values)) + int(bool(windows)) or 1)
    if values:
        for key, (xs, ys) in sorted(values.items()):
            axes[0].plot(xs, ys, drawstyle="steps-post", label=key, marker="." if len(xs) < 3 else None)
        axes[0].set(xlabel="optimizer step", ylabel="value in use", title="scheduled arguments")
    if windows:
        for key, (xs, ys) in sorted(windows.items()):
            axes[-1].plot(xs, ys, drawstyle="steps-post", label=key.partition("/")[0])
        axes[-1].set(xlabel="optimizer step", ylabel="open (1) or closed (0)", ylim=(-0.1, 1.1), title="rule windows")
    return _finish(fig, axes, path)
