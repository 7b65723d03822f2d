"""Trainability held while the stage traces the model's forward.

The trace finds a parameter's uses by the operations autograd connects to it, so it turns the
frozen ones of a rule on for its forwards (``per_sample.trainable.all_trainable``). A model
whose own ``forward`` freezes or unfreezes a layer (``self.backbone.requires_grad_(False)``,
``p.requires_grad = ...``) would switch one off again midway, and its later uses would go
unseen: once unfrozen its calls would not be followed. While the trace runs, such a switch of
a watched parameter is noted, not done; ``settle`` does the last one asked once the trace ends,
so trainability is what the forward left, as after any forward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

_SET = torch._C.TensorBase.__dict__["requires_grad"]  # ``p.requires_grad = on`` calls its __set__


class HeldTrainable(TorchFunctionMode):
    """``asked``: id(param) -> (param, the ``requires_grad`` the forward asked for last)."""

    def __init__(self, watched: set[int]):
        super().__init__()
        self.watched = watched
        self.asked: dict[int, tuple[Tensor, bool]] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is Tensor.requires_grad_ and id(args[0]) in self.watched:
            on = args[1] if len(args) > 1 else kwargs.get("requires_grad", True)
            self.asked[id(args[0])] = (args[0], bool(on))
            return args[0]
        if getattr(func, "__self__", None) is _SET and id(args[0]) in self.watched:
            self.asked[id(args[0])] = (args[0], bool(args[1]))
            return None
        return func(*args, **kwargs)


def settle(asked: dict[int, tuple[Any, bool]]) -> None:
    """Do what the traced forward asked (after the trace put trainability back as it found it)."""
    for p, on in asked.values():
        p.requires_grad_(on)
