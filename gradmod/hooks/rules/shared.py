"""``@shared`` in a rule's ``params`` or ``exclude``: the parameters every task's loss
reaches (a multi-task model's trunk, whatever its modules are called).

Which parameters a loss reaches is a fact of one forward: the leaves its autograd graph
reaches. The trainer finds them from the forward it checks the model with, before the
rules are attached (``gradmod.run.preflight``); in a loop of your own, ``find(model,
losses)`` on one batch's named losses does the same. ``attach`` refuses ``@shared`` on a
model for which neither ran: it cannot be known from the model alone.
"""

from __future__ import annotations

import weakref
from typing import Mapping

from torch import Tensor, nn

SHARED = "@shared"

_FOUND: weakref.WeakKeyDictionary[nn.Module, tuple[str, ...]] = weakref.WeakKeyDictionary()


def reached(loss: Tensor) -> set[int]:
    """The ids of the leaf tensors (parameters) the autograd graph of ``loss`` reaches."""
    found: set[int] = set()
    seen: set[object] = set()
    todo = [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        leaf = getattr(node, "variable", None)  # an AccumulateGrad node: the leaf it fills
        if leaf is not None:
            found.add(id(leaf))
        todo.extend(child for child, _ in node.next_functions)
    return found


def find(model: nn.Module, losses: Tensor | Mapping[str, Tensor]) -> list[str]:
    """The names of the trainable parameters every loss of ``losses`` reaches (one loss:
    those it reaches), in ``model.named_parameters()`` order; kept for ``@shared`` in the
    rules later attached to ``model``."""
    parts = [losses] if isinstance(losses, Tensor) else list(losses.values())
    common = set.intersection(*(reached(loss) for loss in parts)) if parts else set()
    names = [n for n, p in model.named_parameters() if p.requires_grad and id(p) in common]
    _FOUND[model] = tuple(names)
    return names


def found(model: nn.Module) -> list[str] | None:
    """What ``find`` found for ``model``; None where it has not run."""
    names = _FOUND.get(model)
    return None if names is None else list(names)


def matches(where: str, shared: list[str] | None, names: list[str]) -> list[str]:
    """The names ``@shared`` selects among ``names``; one line where it is not known."""
    if shared is None:
        raise ValueError(
            f"{where}: {SHARED} (the parameters every task's loss reaches) is found from a forward of the "
            "model's tasks, which the trainer runs before attaching; in a loop of your own call "
            "gradmod.hooks.rules.shared.find(model, losses) with one batch's named losses first, or name the "
            "parameters by glob"
        )
    chosen = set(shared)
    return [n for n in names if n in chosen]
