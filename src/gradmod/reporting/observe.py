"""What a run shows besides ``metrics.jsonl``: the logger, the gradient statistics kept
for the end-of-run plots, and Grad-CAM snapshots of a few fixed test digits.

The trainer makes four calls: ``RunWatch(...)`` before training, ``before_step`` and
``on_stats`` around the steps, ``on_epoch`` after each evaluation, ``finish`` once at
the end (then ``close``). None of them reads the device between log points: histograms
are binned on the device and come back with the statistics' single read.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from torch import Tensor, nn

from gradmod.data import Data, as_float
from gradmod.reporting.loggers import make_logger
from gradmod.models import build_model
from gradmod.hooks.rules import HookSet


def pick_digits(labels: Tensor, n: int) -> list[int]:
    """Indices of ``n`` test images, one class after another (the first 0, the first
    1, ..., then the second 0, ...): fixed for a given test split."""
    y = labels.cpu().tolist()
    by_class: dict[int, list[int]] = {}
    for i, c in enumerate(y):
        by_class.setdefault(c, []).append(i)
    order = [idx for k in range(max(map(len, by_class.values()))) for c in sorted(by_class)
             for idx in by_class[c][k:k + 1]]
    return order[:n]


class GradCamProbe:
    """Grad-CAM of fixed test digits, computed on a hook-free copy of the model: the
    run's ``modules`` hooks and ``log`` observers must not see Grad-CAM's backward."""

    def __init__(self, model_name: str, data: Data, layer: str, n: int, device: torch.device):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"capture.gradcam_images={n!r} must be an integer >= 1")
        self.model = build_model(model_name, in_channels=data.in_channels, num_classes=data.num_classes,
                                 image_size=data.image_size).to(device).eval()
        modules = [name for name, _ in self.model.named_modules() if name]
        if layer not in modules:
            close = difflib.get_close_matches(str(layer), modules, n=5, cutoff=0.4)
            raise ValueError(f"capture.gradcam_layer={layer!r} is not a module of model {model_name}; "
                             f"close names: {', '.join(close) if close else ', '.join(modules[:5])}")
        self.layer = layer
        idx = torch.tensor(pick_digits(data.test_y, n), device=data.test_y.device)
        self.x = as_float(data.test_x[idx])
        self.y = data.test_y[idx]

    def __call__(self, model: nn.Module) -> dict[str, Any]:
        """images (N x H x W, first channel), cams (N x H x W), labels, preds, on the host."""
        from gradmod.capture import grad_cam

        self.model.load_state_dict(model.state_dict())
        cams = grad_cam(self.model, self.layer, self.x)
        with torch.no_grad():
            preds = self.model(self.x).argmax(1)
        images = self.x[:, 0]
        if self.x.shape[1] > 1:  # colour input: show the mean over channels
            images = self.x.mean(1)
        n, h, w = cams.shape
        host = torch.cat([images.flatten(), cams.flatten().float(), self.y.float(), preds.float()]).cpu().numpy()
        images, cams, labels, preds = np.split(host, np.cumsum([n * h * w, n * h * w, n]))  # one read
        return {"images": images.reshape(n, h, w), "cams": cams.reshape(n, h, w),
                "labels": labels.astype(int).tolist(), "preds": preds.astype(int).tolist()}


def _section(cfg: DictConfig, key: str) -> dict[str, Any]:
    value = cfg.get(key)
    return OmegaConf.to_container(value, resolve=True) if value is not None else {}


class RunWatch:
    """The logger, the statistics history for the plots, and the Grad-CAM probe of one run."""

    def __init__(self, cfg: DictConfig, out: Path, hooks: HookSet, data: Data, device: torch.device):
        self.out = Path(out)
        self.hooks = hooks
        self.log_every = int(cfg.trainer.log_every)
        capture = _section(cfg, "capture")
        self.cam = None
        if capture.get("gradcam", False):
            self.cam = GradCamProbe(str(cfg.model.name), data, capture.get("gradcam_layer", "conv2"),
                                    capture.get("gradcam_images", 8), device)
        self.logger = make_logger(_section(cfg, "logger") or None, self.out)
        self.rows: list[tuple[int, dict[str, Any]]] = []  # (step, stats) for the plots
        self.logger.log_plan(hooks.describe(), hooks.format_plan())
        self.before_step(1)

    def before_step(self, step: int) -> None:
        """Called with the number of the step about to run: bin gradients at log steps."""
        if self.logger.wants_histograms:
            self.hooks.set_histograms(step % self.log_every == 0)

    def on_stats(self, epoch: int, step: int, stats: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
        """Pass a read to the logger; returns it without histograms (for the JSON files)."""
        if not stats:
            return {}
        self.logger.log_stats(epoch, step, stats)
        lean = {k: {f: v for f, v in s.items() if f != "histogram"} for k, s in stats.items()}
        self.rows.append((step, lean))
        return lean

    def on_epoch(self, record: Mapping[str, Any], model: nn.Module) -> None:
        self.logger.log_metrics(int(record["step"]), record)
        if self.cam is not None and self.logger.wants_images:
            from gradmod.reporting.plots import gradcam_overlay

            cam = self.cam(model)
            self.logger.log_images("gradcam", int(record["step"]), gradcam_overlay(cam["images"], cam["cams"]))

    def finish(self, model: nn.Module) -> list[Path]:
        """End-of-run PNGs: gradient norms, fraction clipped, Grad-CAM (those that apply)."""
        from gradmod.reporting.plots import plot_frac_clipped, plot_grad_norms, plot_gradcam

        written = []
        if self.rows:
            written.append(plot_grad_norms(self.rows, self.out / "grad_norms.png"))
            if any("frac_clipped" in s for _, stats in self.rows for s in stats.values()):
                written.append(plot_frac_clipped(self.rows, self.out / "frac_clipped.png"))
        if self.cam is not None:
            cam = self.cam(model)
            titles = [f"{y}/{p}" for y, p in zip(cam["labels"], cam["preds"])]
            written.append(plot_gradcam(torch.from_numpy(cam["images"]), torch.from_numpy(cam["cams"]),
                                        self.out / "gradcam.png", titles=titles,
                                        title=f"Grad-CAM of {self.cam.layer} (label/prediction)"))
        return written

    def close(self) -> None:
        self.logger.close()
