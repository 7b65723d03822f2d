"""Shapes, features, recorded activations and gradients, and Grad-CAM, through forward hooks."""

from __future__ import annotations

import collections
from typing import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from gradmod.capture.probe import output_shape, probe, resolve_layers


def trace_shapes(model: nn.Module, *inputs, leaves: bool = False, print_fn: Callable | None = print):
    """One forward pass (no grad, eval mode) printing and returning each layer's output shape.

    `leaves=False`: direct children, as the article's `VerboseExecution`;
    `leaves=True`: every module without children. A module called twice appears twice.
    Lines are printed as the layers run, so a forward that fails still shows how far it got.
    Returns a list of (layer name, shape).
    """
    if leaves:
        layers = [(n, m) for n, m in model.named_modules() if n and not any(m.children())]
    else:
        layers = list(model.named_children())
    shapes = []

    def hook_for(name):
        def hook(module, args, output):
            shapes.append((name, output_shape(output)))
            if print_fn is not None:
                print_fn(f"{name}: {output_shape(output)}")

        return hook

    probe(model, [(m, hook_for(n)) for n, m in layers], inputs)
    return shapes


class FeatureExtractor:
    """Calling it runs the model and returns `{layer name: output}` (the article's class).

    Outputs are returned as the layers produced them (still in the autograd graph, not
    copied): a later in-place op such as `ReLU(inplace=True)` changes them, exactly as
    with torchvision's `create_feature_extractor`. A layer called twice keeps its last output.
    """

    def __init__(self, model: nn.Module, layers: Iterable[str]):
        self.model = model
        self.layers = resolve_layers(model, layers)
        self._features: dict[str, torch.Tensor] = {}
        self._handles = [m.register_forward_hook(self._hook_for(n)) for n, m in self.layers.items()]

    def _hook_for(self, name):
        def hook(module, args, output):
            self._features[name] = output

        return hook

    def __call__(self, *inputs, **kwargs) -> dict[str, torch.Tensor]:
        self._features = {}  # drop the previous call's tensors before the next forward
        self.model(*inputs, **kwargs)
        missing = [n for n in self.layers if n not in self._features]
        if missing:
            raise RuntimeError(f"layers {missing} did not run in the forward pass")
        features, self._features = {n: self._features[n] for n in self.layers}, {}
        return features

    def remove(self):
        for h in self._handles:
            h.remove()
        self._handles = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()


class Recorder:
    """Stores chosen layers' outputs (per forward) and output gradients (per backward).

    The article's `SaveOutput`, done right: tensors are detached copies (no graph kept
    alive, immune to later in-place ops), moved to `device` (None: stay where they are),
    and each layer keeps only the last `keep` of each in a deque, so memory stays flat
    over a long run. `outputs[name][-1]` / `grads[name][-1]` are the newest. A layer
    called twice in one forward adds two entries (its gradients arrive in reverse order).
    """

    def __init__(self, model: nn.Module, layers: Iterable[str], keep: int = 1, device="cpu"):
        if not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be an int >= 1, got {keep!r}")
        self.layers = resolve_layers(model, layers)
        self.device = device
        self.outputs = {n: collections.deque(maxlen=keep) for n in self.layers}
        self.grads = {n: collections.deque(maxlen=keep) for n in self.layers}
        # Tensor-hook handles on recent outputs; older ones die with their graphs.
        self._tensor_handles = collections.deque(maxlen=keep * len(self.layers))
        self._handles = [m.register_forward_hook(self._hook_for(n)) for n, m in self.layers.items()]
        self._active = True

    def _store(self, t: torch.Tensor) -> torch.Tensor:
        return t.detach().to(self.device or t.device, copy=True)

    def _hook_for(self, name):
        def grad_hook(grad):
            if self._active:  # a graph built before remove() may still run backward
                self.grads[name].append(self._store(grad))

        def forward_hook(module, args, output):
            if not isinstance(output, torch.Tensor):
                raise TypeError(f"Recorder needs a tensor output from layer {name!r}, got {type(output).__name__}")
            self.outputs[name].append(self._store(output))
            if output.requires_grad:
                self._tensor_handles.append(output.register_hook(grad_hook))

        return forward_hook

    def output(self, name: str) -> torch.Tensor:
        return self.outputs[name][-1]

    def grad(self, name: str) -> torch.Tensor:
        return self.grads[name][-1]

    def clear(self):
        for d in (*self.outputs.values(), *self.grads.values()):
            d.clear()

    def nbytes(self) -> int:
        """Bytes held by the stored tensors."""
        stored = [t for d in (*self.outputs.values(), *self.grads.values()) for t in d]
        return sum(t.numel() * t.element_size() for t in stored)

    def remove(self):
        self._active = False
        for h in (*self._handles, *self._tensor_handles):
            h.remove()
        self._handles = []
        self._tensor_handles.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()


def grad_cam(model: nn.Module, layer, inputs: torch.Tensor, target=None) -> torch.Tensor:
    """Grad-CAM maps (N x H x W, non-negative) of `layer` for a batch of N images.

    weights_c = spatial mean of d score / d A_c; map = relu(sum_c weights_c * A_c),
    upsampled bilinearly to the input's H x W. `target`: class index (int or one per
    input); default the predicted class. `layer`: a name from `named_modules()` or a module.
    Gradients come from `torch.autograd.grad`, so no parameter `.grad` is touched.
    Scores are summed over the batch, which gives each input its own gradient only if
    inputs do not interact: call `model.eval()` first for models with BatchNorm.
    """
    module = layer if isinstance(layer, nn.Module) else resolve_layers(model, [layer])[layer]
    captured = []
    handle = module.register_forward_hook(lambda m, args, out: captured.append(out))
    try:
        with torch.enable_grad():
            # An input that requires grad makes the activation differentiable even when
            # the model's parameters are frozen.
            logits = model(inputs.detach().requires_grad_(True))
            if not captured:
                raise ValueError(f"layer {layer!r} did not run in the forward pass")
            acts = captured[-1]
            if acts.dim() != 4:
                raise ValueError(
                    f"grad_cam needs an N x C x H x W activation; layer {layer!r} gave {tuple(acts.shape)}"
                )
            if target is None:
                target = logits.argmax(dim=1)
            target = torch.as_tensor(target, device=logits.device).expand(logits.shape[0])
            score = logits.gather(1, target[:, None]).sum()
            (grads,) = torch.autograd.grad(score, acts)
    finally:
        handle.remove()
    weights = grads.mean(dim=(2, 3), keepdim=True)
    cam = F.relu((weights * acts).sum(dim=1, keepdim=True))
    cam = F.interpolate(cam, size=inputs.shape[-2:], mode="bilinear", align_corners=False)
    return cam[:, 0].detach()
