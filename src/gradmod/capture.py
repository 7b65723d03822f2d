"""Forward-hook tools: shapes, features, recorded activations/gradients, Grad-CAM, summary.

Every tool keeps the handles it registers and removes them when done (a `try/finally`
for one-shot functions, `remove()` / `with` for the classes), so `list_hooks(model)`
reads the same before and after.
"""

from __future__ import annotations

import collections
import contextlib
import difflib
import math
from typing import Callable, Iterable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "trace_shapes",
    "FeatureExtractor",
    "Recorder",
    "grad_cam",
    "summary",
    "summary_rows",
    "list_hooks",
    "HookEntry",
    "HookListing",
]


def _resolve_layers(model: nn.Module, names: Iterable[str]) -> dict[str, nn.Module]:
    """Map layer names (as in `named_modules()`) to modules; unknown names raise ValueError."""
    modules = dict(model.named_modules())
    layers = {}
    for name in names:
        if not isinstance(name, str) or name not in modules:
            close = difflib.get_close_matches(str(name), [n for n in modules if n], n=5)
            raise ValueError(
                f"unknown layer {name!r}; close names: {close or 'none'} "
                f"(all names: [n for n, _ in model.named_modules()])"
            )
        layers[name] = modules[name]
    return layers


def _shape(output):
    """Shape of a tensor output; a list of shapes for tuple/list outputs."""
    if isinstance(output, torch.Tensor):
        return output.shape
    if isinstance(output, (tuple, list)):
        return [_shape(o) for o in output]
    return type(output).__name__


@contextlib.contextmanager
def _eval_mode(model: nn.Module):
    """Eval mode for a probing forward pass, so BatchNorm running stats stay untouched.

    Each module's own flag is restored (a plain `model.train()` would also unfreeze
    modules the user had put in eval mode on purpose).
    """
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


def _probe(model: nn.Module, hooks: list[tuple[nn.Module, Callable]], inputs) -> None:
    """One forward pass (no grad, eval mode) with temporary forward hooks, removed even
    when the forward fails."""
    handles = [m.register_forward_hook(fn) for m, fn in hooks]
    try:
        with torch.no_grad(), _eval_mode(model):
            model(*inputs)
    finally:
        for h in handles:
            h.remove()


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
            shapes.append((name, _shape(output)))
            if print_fn is not None:
                print_fn(f"{name}: {_shape(output)}")

        return hook

    _probe(model, [(m, hook_for(n)) for n, m in layers], inputs)
    return shapes


class FeatureExtractor:
    """Calling it runs the model and returns `{layer name: output}` (the article's class).

    Outputs are returned as the layers produced them (still in the autograd graph, not
    copied): a later in-place op such as `ReLU(inplace=True)` changes them, exactly as
    with torchvision's `create_feature_extractor`. A layer called twice keeps its last output.
    """

    def __init__(self, model: nn.Module, layers: Iterable[str]):
        self.model = model
        self.layers = _resolve_layers(model, layers)
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
        self.layers = _resolve_layers(model, layers)
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
    module = layer if isinstance(layer, nn.Module) else _resolve_layers(model, [layer])[layer]
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
                raise ValueError(f"grad_cam needs an N x C x H x W activation; layer {layer!r} gave {tuple(acts.shape)}")
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


class SummaryRow(NamedTuple):
    layer: str  # "Conv2d-1": type and call index, as torchsummary
    output_shape: list  # batch dimension shown as -1
    params: int
    trainable: int


def summary_rows(model: nn.Module, input_size, batch_size: int = -1, dtype=torch.float32) -> list[SummaryRow]:
    """One row per call of a leaf module (a module without children), in call order.

    Leaves only, so containers (Sequential, a ResNet block) never count a parameter
    twice; for the article's Net (functional relu/max_pool) that is conv1, conv2, l1.
    Parameters owned directly by a non-leaf module are in the totals, not in the rows.
    """
    sizes = [input_size] if isinstance(input_size[0], int) else list(input_size)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    rows = []

    def hook(module, args, output):
        shape = _shape(output)
        shape = [[batch_size, *s[1:]] for s in shape] if isinstance(shape, list) else [batch_size, *shape[1:]]
        own = list(module.parameters(recurse=False))
        rows.append(SummaryRow(
            f"{type(module).__name__}-{len(rows) + 1}",
            shape,
            sum(p.numel() for p in own),
            sum(p.numel() for p in own if p.requires_grad),
        ))

    leaves = [m for m in model.modules() if not any(m.children()) and m is not model]
    # Batch of 2, as torchsummary, so BatchNorm accepts it.
    inputs = [torch.rand(2, *s, dtype=dtype, device=device) for s in sizes]
    _probe(model, [(m, hook) for m in leaves], inputs)
    return rows


def summary(model: nn.Module, input_size, batch_size: int = -1, dtype=torch.float32) -> str:
    """The torchsummary table as text: rows from `summary_rows`, totals from the model.

    `input_size`: (C, H, W) or a list of them for several inputs. Sizes in MB follow
    torchsummary (4 bytes per value, activations counted twice for their gradients).
    """
    sizes = [input_size] if isinstance(input_size[0], int) else list(input_size)
    rows = summary_rows(model, input_size, batch_size, dtype)
    params = {id(p): p for p in model.parameters()}.values()  # shared weights once
    total = sum(p.numel() for p in params)
    trainable = sum(p.numel() for p in params if p.requires_grad)

    def numel(shape):
        if shape and isinstance(shape[0], list):
            return sum(numel(s) for s in shape)
        return abs(math.prod(shape))

    mb = 4.0 / 1024**2
    input_mb = sum(math.prod(s) for s in sizes) * abs(batch_size) * mb
    activations_mb = 2 * sum(numel(r.output_shape) for r in rows) * mb
    params_mb = total * mb
    line, double = "-" * 64, "=" * 64
    text = [line, "{:>20}  {:>25} {:>15}".format("Layer (type)", "Output Shape", "Param #"), double]
    text += ["{:>20}  {:>25} {:>15}".format(r.layer, str(r.output_shape), f"{r.params:,}") for r in rows]
    text += [
        double,
        f"Total params: {total:,}",
        f"Trainable params: {trainable:,}",
        f"Non-trainable params: {total - trainable:,}",
        line,
        f"Input size (MB): {input_mb:0.2f}",
        f"Forward/backward pass size (MB): {activations_mb:0.2f}",
        f"Params size (MB): {params_mb:0.2f}",
        f"Estimated Total Size (MB): {input_mb + activations_mb + params_mb:0.2f}",
        line,
    ]
    return "\n".join(text)


class HookEntry(NamedTuple):
    name: str  # module or parameter name; "" for the root module or a bare tensor
    kind: str  # the dictionary the hooks live in, e.g. "_forward_hooks"
    count: int


class HookListing(NamedTuple):
    entries: list[HookEntry]
    total: int


_MODULE_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_TENSOR_HOOK_DICTS = ("_backward_hooks", "_post_accumulate_grad_hooks")


def _tensor_entries(name: str, t: torch.Tensor) -> list[HookEntry]:
    entries = []
    for kind in _TENSOR_HOOK_DICTS:
        n = len(getattr(t, kind, None) or {})  # None until a hook was ever registered
        if n:
            entries.append(HookEntry(name, kind, n))
    return entries


def list_hooks(obj) -> HookListing:
    """Hooks currently registered on a module tree (every submodule and parameter) or a tensor.

    Global hooks (`torch.nn.modules.module.register_module_forward_hook`) are not listed.
    """
    if isinstance(obj, torch.Tensor):
        entries = _tensor_entries("", obj)
    elif isinstance(obj, nn.Module):
        entries = []
        for name, module in obj.named_modules():
            for kind in _MODULE_HOOK_DICTS:
                n = len(getattr(module, kind))
                if n:
                    entries.append(HookEntry(name, kind, n))
            for pname, p in module.named_parameters(prefix=name, recurse=False):
                entries += _tensor_entries(pname, p)
    else:
        raise TypeError(f"list_hooks needs an nn.Module or a Tensor, got {type(obj).__name__}")
    return HookListing(entries, sum(e.count for e in entries))
