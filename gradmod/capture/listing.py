"""A model's summary table, and a listing of the hooks registered on it."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import nn

from gradmod.capture.probe import output_shape, probe


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
        shape = output_shape(output)
        shape = [[batch_size, *s[1:]] for s in shape] if isinstance(shape, list) else [batch_size, *shape[1:]]
        own = list(module.parameters(recurse=False))
        rows.append(
            SummaryRow(
                f"{type(module).__name__}-{len(rows) + 1}",
                shape,
                sum(p.numel() for p in own),
                sum(p.numel() for p in own if p.requires_grad),
            )
        )

    leaves = [m for m in model.modules() if not any(m.children()) and m is not model]
    # Batch of 2, as torchsummary, so BatchNorm accepts it.
    inputs = [torch.rand(2, *s, dtype=dtype, device=device) for s in sizes]
    probe(model, [(m, hook) for m in leaves], inputs)
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
