"""Grad-CAM snapshots of a few fixed test digits, taken during a run."""

from __future__ import annotations

import difflib
import functools
from typing import Any, Callable

import numpy as np
import torch
from torch import Tensor, nn

from gradmod.data import Data, as_float
from gradmod.models import build_model


def pick_digits(labels: Tensor, n: int) -> list[int]:
    """Indices of ``n`` test images, one class after another (the first 0, the first
    1, ..., then the second 0, ...): fixed for a given test split."""
    y = labels.cpu().tolist()
    by_class: dict[int, list[int]] = {}
    for i, c in enumerate(y):
        by_class.setdefault(c, []).append(i)
    order = [
        idx for k in range(max(map(len, by_class.values()))) for c in sorted(by_class) for idx in by_class[c][k : k + 1]
    ]
    return order[:n]


class GradCamProbe:
    """Grad-CAM of fixed test digits, computed on a hook-free copy of the model: the
    run's ``modules`` hooks and ``log`` observers must not see Grad-CAM's backward."""

    def __init__(self, model_name: str | Callable[[], nn.Module], data: Data, layer: str, n: int, device: torch.device):
        """``model_name``: a shipped model's name, or a function building a fresh model (a
        ``_target_`` model: ``gradmod.run.factories.model_factory``)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"capture.gradcam_images={n!r} must be an integer >= 1")
        build = (
            model_name
            if callable(model_name)
            else functools.partial(
                build_model,
                model_name,
                in_channels=data.in_channels,
                num_classes=data.num_classes,
                image_size=data.image_size,
            )
        )
        model_name = model_name if isinstance(model_name, str) else "(the model._target_)"
        self.model = build().to(device).eval()
        modules = [name for name, _ in self.model.named_modules() if name]
        if layer not in modules:
            close = difflib.get_close_matches(str(layer), modules, n=5, cutoff=0.4)
            raise ValueError(
                f"capture.gradcam_layer={layer!r} is not a module of model {model_name}; "
                f"close names: {', '.join(close) if close else ', '.join(modules[:5])}"
            )
        self.layer = layer
        idx = torch.tensor(pick_digits(data.test_y, n), device=data.test_y.device)
        self.x = as_float(data.test_x[idx])
        self.y = data.test_y[idx]
        self._check_layer(dict(self.model.named_modules())[layer])

    def _check_layer(self, module: nn.Module) -> None:
        """Grad-CAM weighs a layer's channels over its spatial map: its output must be
        N x C x H x W. Checked on one image now, not at the end of the first epoch."""
        seen: list[Any] = []
        handle = module.register_forward_hook(lambda m, i, out: seen.append(out))
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=[]):
                self.model(self.x[:1])
        finally:
            handle.remove()
        out = seen[0] if seen else None
        if not (isinstance(out, Tensor) and out.ndim == 4):
            got = (
                (f"shape {tuple(out.shape)}" if isinstance(out, Tensor) else type(out).__name__)
                if seen
                else "nothing (not called in forward)"
            )
            raise ValueError(
                f"capture.gradcam_layer={self.layer!r} outputs {got}; Grad-CAM "
                "needs a layer whose output is N x C x H x W (a convolution, e.g. conv2 or layer4)"
            )

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
        return {
            "images": images.reshape(n, h, w),
            "cams": cams.reshape(n, h, w),
            "labels": labels.astype(int).tolist(),
            "preds": preds.astype(int).tolist(),
        }
