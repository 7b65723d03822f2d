"""Named labels: one tensor per task for the same examples, indexed together.

A multi-task dataset (MultiMNIST's ``left`` and ``right`` digits) keeps its labels as
``Labels``; the loader indexes, splits, pins and moves them exactly as it does one label
tensor, so the epoch's batches are the same whichever the data holds. ``labels["left"]``
is that task's tensor; ``labels[idx]`` (an index tensor or a slice) the labels of those
examples; ``len(labels)`` the number of examples.
"""

from __future__ import annotations

from typing import Iterator, Mapping

import torch
from torch import Tensor


class Labels:
    """Label tensors by task name, each with one row per example."""

    def __init__(self, tensors: Mapping[str, Tensor]):
        self.tensors = dict(tensors)
        sizes = {k: len(v) for k, v in self.tensors.items()}
        if not sizes or len(set(sizes.values())) != 1 or not all(isinstance(k, str) for k in sizes):
            raise ValueError(f"labels by task need one or more names with tensors of one length each; got {sizes}")

    def __len__(self) -> int:
        return len(next(iter(self.tensors.values())))

    def __getitem__(self, index):
        if isinstance(index, str):
            return self.tensors[index]
        return Labels({k: v[index] for k, v in self.tensors.items()})

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def __repr__(self) -> str:
        return "Labels(" + ", ".join(f"{k}: {tuple(v.shape)} {v.dtype}" for k, v in self.tensors.items()) + ")"

    def keys(self):
        return self.tensors.keys()

    def items(self):
        return self.tensors.items()

    def values(self):
        return self.tensors.values()

    @property
    def device(self) -> torch.device:
        return next(iter(self.tensors.values())).device

    def to(self, device, non_blocking: bool = False) -> Labels:
        return Labels({k: v.to(device, non_blocking=non_blocking) for k, v in self.tensors.items()})

    def pin_memory(self) -> Labels:  # DataLoader(pin_memory=True) calls this
        return Labels({k: v.pin_memory() for k, v in self.tensors.items()})

    def split(self, size: int) -> tuple[Labels, ...]:
        return _zip_parts({k: v.split(size) for k, v in self.tensors.items()})

    def tensor_split(self, parts: int) -> tuple[Labels, ...]:
        return _zip_parts({k: v.tensor_split(parts) for k, v in self.tensors.items()})

    def nbytes(self) -> int:
        return sum(v.numel() * v.element_size() for v in self.tensors.values())


def _zip_parts(parts: dict[str, tuple[Tensor, ...]]) -> tuple[Labels, ...]:
    names = list(parts)
    return tuple(Labels(dict(zip(names, row))) for row in zip(*parts.values()))


def nbytes(y: Tensor | Labels) -> int:
    """Memory a label tensor or ``Labels`` takes."""
    return y.nbytes() if isinstance(y, Labels) else y.numel() * y.element_size()


def class_count(y: Tensor | Labels) -> int:
    """One more than the largest integer label over every task (0 for float labels)."""
    tensors = list(y.values()) if isinstance(y, Labels) else [y]
    ints = [t for t in tensors if not t.dtype.is_floating_point and t.dtype != torch.bool and t.numel()]
    return max((int(t.max()) + 1 for t in ints), default=0)
