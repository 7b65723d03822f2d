"""Shared by the capture tools: layers by name, output shapes, a probing forward pass."""

from __future__ import annotations

import contextlib
import difflib
from typing import Callable, Iterable

import torch
from torch import nn


def resolve_layers(model: nn.Module, names: Iterable[str]) -> dict[str, nn.Module]:
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


def output_shape(output):
    """Shape of a tensor output; a list of shapes for tuple/list outputs."""
    if isinstance(output, torch.Tensor):
        return output.shape
    if isinstance(output, (tuple, list)):
        return [output_shape(o) for o in output]
    return type(output).__name__


@contextlib.contextmanager
def eval_mode(model: nn.Module):
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


def probe(model: nn.Module, hooks: list[tuple[nn.Module, Callable]], inputs) -> None:
    """One forward pass (no grad, eval mode) with temporary forward hooks, removed even
    when the forward fails."""
    handles = [m.register_forward_hook(fn) for m, fn in hooks]
    try:
        with torch.no_grad(), eval_mode(model):
            model(*inputs)
    finally:
        for h in handles:
            h.remove()
