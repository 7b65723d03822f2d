"""Weights kept out of autograd's graph where the stage computes their gradient itself.

Autograd computes each Linear's batch weight gradient, which the per_sample stage drops for
its clipped sum: a matmul as large as the per-example weights it forms anyway. After the
first backward (whose whole gradients check every form against autograd's), each followed
call of a Linear, Hugging Face's Conv1D or an Embedding whose weight is clipped and used by
such calls only runs on a detached alias of its weight and bias: the output gradient the
stage needs is still computed (an output that would leave the graph, its input being token
ids or data, hangs from a leaf of its own), the weight gradient is not. A gradient that still
reaches such a parameter came from a use the stage does not follow: refused in one line.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from gradmod.hooks.per_sample.accounts import OUTSIDE
from gradmod.hooks.per_sample.layers import Conv1DForm, EmbeddingForm, LinearForm
from gradmod.hooks.per_sample.tracing import followed_forward

NAMES = ("weight", "bias")  # what these forms answer for: any other parameter keeps its graph


class Detacher:
    """The parameters whose followed calls run detached, once ``active`` (after the first backward)."""

    def __init__(self) -> None:
        self.active = False
        self.params: set[int] = set()
        self._saved: dict[int, list[dict[str, nn.Parameter] | None]] = {}

    def install(self, layers: list, rules: list) -> list[Any]:
        """Hooks on the layers answering for detachable parameters: those of clipping rules (a
        log-only rule keeps autograd's gradient) that only such layers use."""
        clipped = {id(p) for r in rules if r.clip is not None for p in r.params}
        held: dict[int, list] = {}
        for layer in layers:
            for p in layer.names.values():
                held.setdefault(id(p), []).append(layer)
        handles = []
        for layer in layers:
            names = {
                n: p
                for n, p in layer.names.items()
                if n in NAMES and id(p) in clipped and all(_detachable(x) for x in held[id(p)])
            }
            if names and _detachable(layer):
                self.params |= {id(p) for p in names.values()}
                m = layer.module
                handles += [
                    m.register_forward_pre_hook(self._detach(tuple(names))),
                    m.register_forward_hook(self._restore, prepend=True, always_call=True),  # before the stage's
                ]
        return handles

    def _detach(self, names: tuple[str, ...]):
        def hook(m: nn.Module, args: tuple) -> None:
            stack = self._saved.setdefault(id(m), [])
            if not (self.active and followed_forward()):
                stack.append(None)
                return
            saved = {n: m._parameters[n] for n in names if m._parameters.get(n) is not None}
            stack.append(saved)  # type: ignore[arg-type]
            for n, p in saved.items():
                m._parameters[n] = p.detach()  # type: ignore[assignment]

        return hook

    def _restore(self, m: nn.Module, args: tuple, output: Any) -> Any:
        stack = self._saved.get(id(m))
        saved = stack.pop() if stack else None
        if not saved:
            return None
        m._parameters.update(saved)
        if isinstance(output, Tensor) and not output.requires_grad and output.is_floating_point():
            # an input outside the graph (token ids, the data): the output still carries the gradient,
            # from a leaf of its own (cloned: in-place operations on the output stay allowed)
            return output.detach().requires_grad_().clone()
        return None

    def refuse_arrivals(self, got: dict[int, Any], names: dict[int, str]) -> None:
        """A detached parameter got a gradient from autograd: a use outside the followed calls."""
        if not self.active:
            return
        arrived = next((i for i in got if i in self.params), None)
        if arrived is not None:
            raise ValueError(
                f"per_sample: {names[arrived]!r} {OUTSIDE}, here after the first backward); that part "
                "has no per-example split, so the parameter cannot be clipped"
            )


def _detachable(layer) -> bool:
    return isinstance(layer.form, (LinearForm, Conv1DForm, EmbeddingForm)) and not layer.broadcast
