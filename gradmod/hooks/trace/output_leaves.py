"""The model's output leaves as a trace keeps them, to tell whether a changed forward gives
the very same outputs: tensors detached, and an object of its own (Hugging Face's key/value
cache, new at every forward) by its type and the tensors it holds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.nn.utils.rnn import PackedSequence

# Inputs a replay can pass again as they were (anything else may hold state a call changes).
PLAIN = (Tensor, PackedSequence, int, float, complex, str, bytes, type(None), torch.dtype, torch.device, torch.Size)


@dataclass(frozen=True)
class Held:
    """An output leaf that is an object of its own (Hugging Face's key/value cache, new at
    every forward): its type and the tensors it holds, detached."""

    kind: type
    tensors: tuple[Tensor, ...]


def kept(x: Any) -> Any:
    """An output leaf as a trace keeps it to compare with: out of the graph."""
    if isinstance(x, Tensor):
        return x.detach()
    if isinstance(x, PLAIN):
        return x
    return Held(type(x), tuple(t.detach() for t in _held(x)))


def alike(a: Any, b: Any) -> bool:
    if isinstance(a, Tensor) and isinstance(b, Tensor):
        return torch.equal(a, b)
    if isinstance(a, Held) and isinstance(b, Held):
        return (
            a.kind is b.kind
            and len(a.tensors) == len(b.tensors)
            and all(torch.equal(x, y) for x, y in zip(a.tensors, b.tensors))
        )
    return type(a) is type(b) and a == b


def _held(x: Any, depth: int = 4) -> list[Tensor]:
    """The tensors an object holds, in its attributes, lists and dicts (``depth`` levels down)."""
    if isinstance(x, Tensor):
        return [x]
    if depth == 0 or isinstance(x, PLAIN):
        return []
    if isinstance(x, dict):
        parts = list(x.values())
    elif isinstance(x, (list, tuple)):
        parts = list(x)
    else:
        parts = list(getattr(x, "__dict__", {}).values())
    return [t for part in parts for t in _held(part, depth - 1)]
