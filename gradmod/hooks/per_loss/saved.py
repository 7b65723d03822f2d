"""What the training forwards leave for the per_loss stage's backward.

The first training forward is traced once (``gradmod.hooks.trace.first_forward.param_uses``): a Linear with
torch's own forward may be answered from its (input, output gradient) pairs only when every
use of its weight and bias ran inside its own forward and no other module holds them: not
attention's ``out_proj`` (used inside ``F.multi_head_attention_forward``), not a weight also
used through ``F.linear``, not a weight tied to another module. Such a layer's calls are
saved (``entries.Layer``); every other parameter of a gradient rule is answered directly.
Saved besides: the outputs of each ``modules:`` rule's modules and of the frontier (the
smallest module holding every gradient rule's tensors: ``frontier_module``), and the nodes of the
model's outputs (below them the trace saw every use).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.graph import get_gradient_edge
from torch.utils import _pytree as pytree
from torch.utils.hooks import RemovableHandle

from gradmod.hooks.per_loss.entries import Layer
from gradmod.hooks.per_loss.loss_rules import LossRule
from gradmod.hooks.trace.first_forward import followed_forward, param_uses

CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)  # held, never called


class Saved:
    """The forward hooks of one stage and what they saved since the last backward.

    ``rules``: every per_loss rule (a ``modules:`` rule's outputs are saved), ``grad_rules``
    those whose method needs the task gradients; ``owner``: id(param) -> the gradient rule
    that holds it; ``inside``: True while the stage runs its own backward passes (a Linear's
    output refuses any other that fills ``.grad``: ``fills_grad()``, ``Core.fills_grad``; a
    gradient the loss takes of itself, ``torch.autograd.grad``, passes)."""

    def __init__(
        self, model: nn.Module, rules: list[LossRule], grad_rules: list[LossRule], fills_grad: Callable[[], bool]
    ):
        self.model, self.owner, self.fills_grad = model, held_by(grad_rules), fills_grad
        self.inside = False
        self.layers: list[Layer] = []
        # Until the first training forward is traced, every parameter is answered directly.
        self.direct = {id(p): (r, p) for r in grad_rules for p in r.params}
        self.outputs: dict[int, list[Tensor]] = {}  # id(module) -> its outputs: a module rule's, the frontier's
        self.model_outputs: list = []  # the model's outputs' nodes: the trace saw what lies below them
        self.autocast: torch.dtype | None = None  # autocast's dtype in the last training forward, if on
        self.handles: list[RemovableHandle] = []
        self._traced = self._tracing = False
        if self.owner:
            self.handles.append(model.register_forward_pre_hook(self._first_forward, with_kwargs=True))
            self.handles.append(model.register_forward_hook(self._save_model_output))
        modules = [m for r in rules for m in r.modules]
        shared = None if modules else frontier_module(model, [p for r in grad_rules for p in r.params])
        self.frontier = None if shared is None else id(shared)
        for m in modules + ([] if shared is None else [shared]):
            self.outputs[id(m)] = []
            self.handles.append(m.register_forward_hook(self._save_output(m)))

    def frontier_outputs(self) -> list[Tensor]:
        return self.outputs.get(self.frontier, []) if self.frontier is not None else []

    def check_ran(self, rules: list[LossRule]) -> None:
        """A ``modules:`` rule's module ran in a training forward before this backward."""
        for r in rules:
            if r.modules and not any(self.outputs[id(m)] for m in r.modules):
                raise ValueError(
                    f"hooks.{r.name}: no module of this modules rule ran in a training forward (gradients "
                    "on) before this backward, so there is no output whose task gradients to combine"
                )

    def clear(self) -> None:
        """Forget this backward's forward (after it, or when the stage is removed)."""
        for layer in self.layers:
            layer.calls = []
        for k in self.outputs:
            self.outputs[k] = []
        self.model_outputs = []

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        self.clear()

    # ---- the hooks ----

    def _first_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """The first training forward is traced once, to assign the layers."""
        if self._traced or self._tracing or not followed_forward():
            return
        self._tracing = True
        try:
            uses = param_uses(module, args, kwargs, set(self.owner))
        finally:
            self._tracing = False
        self._traced = True
        for layer in assign_layers(self.model, self.owner, uses):
            self.layers.append(layer)
            self.handles.append(layer.module.register_forward_hook(self._save(layer)))
            for p in layer.module.parameters(recurse=False):
                self.direct.pop(id(p), None)

    def _save(self, layer: Layer) -> Callable:
        def hook(module, args, output):
            if isinstance(output, Tensor) and not self._tracing and _active([output]):
                layer.calls.append((args[0].detach(), get_gradient_edge(output)))
                output.register_hook(self._guard(layer.rule))

        return hook

    def _save_model_output(self, module, args, output) -> None:
        outs = [t for t in pytree.tree_leaves(output) if isinstance(t, Tensor)]
        if not self._tracing and _active(outs):
            self.model_outputs += [t.grad_fn for t in outs if t.grad_fn is not None]
            self.autocast = _autocast(outs[0].device.type)

    def _save_output(self, m: nn.Module) -> Callable:
        def hook(module, args, output):
            if torch.compiler.is_compiling():
                # Compiled with what follows, the output would be one more output of a node
                # that also makes the losses' heads: the losses never reach it, so its task
                # gradients could not be caught (a loss weighting then did nothing). It ends a graph.
                torch._dynamo.graph_break()
            outs = [t for t in pytree.tree_leaves(output) if isinstance(t, Tensor)]  # an LSTM's (h, c) too
            if not self._tracing and _active(outs):
                self.outputs[id(m)].extend(t for t in outs if t.requires_grad)

        return hook

    def _guard(self, rule: LossRule) -> Callable:
        def hook(g):
            if not self.inside and self.fills_grad():
                raise RuntimeError(
                    f"hooks.{rule.name}: a per_loss rule needs its losses through "
                    "hooks.backward(losses), not loss.backward()"
                )

        return hook


def factored_forward(m: nn.Module) -> bool:
    """A Linear with torch's own forward (a subclass's forward may do anything)."""
    return isinstance(m, nn.Linear) and type(m).forward is nn.Linear.forward


def assign_layers(model: nn.Module, owner: dict[int, Any], uses: dict[int, list]) -> list[Layer]:
    """The layers answered from their calls; ``owner``: id(param) -> its gradient rule."""
    holders: dict[int, int] = {}
    for m in model.modules():
        for p in m.parameters(recurse=False):
            holders[id(p)] = holders.get(id(p), 0) + 1
    layers = []
    for m in model.modules():
        mine = {n: p for n, p in m.named_parameters(recurse=False) if id(p) in owner}
        if not mine or not factored_forward(m):
            continue
        rules = {id(owner[id(p)]) for p in mine.values()}
        inside = all(uses.get(id(p)) and all(s and s[-1] is m for s in uses[id(p)]) for p in mine.values())
        if len(rules) == 1 and inside and all(holders[id(p)] == 1 for p in mine.values()):
            layers.append(Layer(m, owner[id(next(iter(mine.values())))], set(mine)))
    return layers


def held_by(grad_rules: list[LossRule]) -> dict[int, LossRule]:
    """id(param) -> the gradient rule that holds it."""
    return {id(p): r for r in grad_rules for p in r.params}


def _autocast(where: str) -> torch.dtype | None:
    """The dtype autocast computes in on device type ``where`` now, or None where it is off
    (or has no autocast: a meta tensor's)."""
    on = torch.amp.is_autocast_available(where) and torch.is_autocast_enabled(where)
    return torch.get_autocast_dtype(where) if on else None


def frontier_module(model: nn.Module, params: list[nn.Parameter]) -> nn.Module | None:
    """The deepest module below the model whose subtree holds every one of ``params`` and
    which is called (a ModuleList's layers: the module holding the list)."""
    wanted = {id(p) for p in params}
    owners = [name.split(".")[:-1] for name, p in model.named_parameters(remove_duplicate=False) if id(p) in wanted]
    common = os.path.commonprefix(owners) if owners else []
    while common and isinstance(model.get_submodule(".".join(common)), CONTAINERS):
        common = common[:-1]
    return model.get_submodule(".".join(common)) if common else None


def refuse_sparse(model: nn.Module, grad_rules: list[LossRule]) -> None:
    """A sparse embedding's gradient has no per-task Gramian here: one line names it."""
    owner = held_by(grad_rules)
    for n, m in model.named_modules():
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse and id(m.weight) in owner:
            raise ValueError(
                f"hooks.{owner[id(m.weight)].name}: {n + '.weight'!r} has sparse gradients (sparse=True), "
                "which have no per-task Gramian; use sparse=False or leave it out of the rule"
            )


def _active(outs: list[Tensor]) -> bool:
    return followed_forward() and any(t.requires_grad for t in outs)
