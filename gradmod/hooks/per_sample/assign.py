"""Which module call answers for each parameter of a per_sample rule, from the trace.

A parameter every use of which ran inside the forward of a module that holds it and has a
closed form (Linear, Conv, norms, Embedding, RNNs, a registered form) is that module's. Any
other (used functionally, by a parent, by two modules, through a parametrization) goes to
the general path: ``torch.func`` on the smallest module whose forward covers every use and
whose outputs all carry the batch. Where no module does, one line names the parameter.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from gradmod.hooks.per_sample.forms.layers import FUNC, Form, form_of
from gradmod.hooks.trace.first_forward import PACKED, UNKNOWN, Trace


@dataclass
class Layer:
    """A module whose calls the stage follows: its form, the parameters (local, possibly
    dotted names) it answers for, and the batch dimension of its inputs and outputs."""

    module: nn.Module
    form: Form
    names: dict[str, nn.Parameter]  # local name -> parameter
    in_dims: Any = None  # the (args, kwargs) tree of batch dims (None: a shared leaf)
    out_dims: list = field(default_factory=list)
    materialise: bool = False  # weights shared with another layer: per-example tensors needed
    broadcast: bool = False  # called without the batch (one row); its output is expanded to the batch
    rows: tuple[int, ...] | None = None  # with broadcast: which output tensors (None: the one output)
    materialised: bool | None = None  # at its last backward: per-example tensors formed (None: none yet)
    hung: list = field(
        default_factory=list
    )  # the parameters its running call took detached (``detached_weights.hang``)

    @property
    def first_in(self) -> Any:
        return next(iter(pytree.tree_leaves(self.in_dims)), None)


@dataclass
class Call:
    """One forward call of a layer: its input and, after backward, its output gradients."""

    layer: Layer
    inputs: Any
    shapes: list[tuple[torch.Size, torch.dtype, torch.device]]
    grads: list[Tensor | None] = field(default_factory=list)
    formed: dict[str, Tensor] | None = None  # per-example gradients it formed in the backward
    only: frozenset[str] | None = None  # the local names it gives a part of (None: all its layer's)

    @classmethod
    def of(cls, layer: Layer, inputs: Any, outs: list[Tensor]) -> Call:
        """A call whose outputs ``outs`` get their gradients later (in the parameters' dtype: autocast)."""
        dtype = next(iter(layer.names.values())).dtype
        shapes = [(t.shape, dtype if t.is_floating_point() else t.dtype, t.device) for t in outs]
        return cls(layer, inputs, shapes, [None] * len(outs))

    @property
    def names(self) -> dict[str, nn.Parameter]:
        """The parameters it gives a part of (local name -> parameter)."""
        names = self.layer.names
        return names if self.only is None else {n: p for n, p in names.items() if n in self.only}

    def output_grads(self):
        """The output gradient(s) (outputs that got none count as zeros): for a recording form
        each recorded output's as it came, for a whole-call form (gradient, batch dim) pairs,
        else the first, batch first."""
        grads = [torch.zeros(s, dtype=t, device=d) if g is None else g for g, (s, t, d) in zip(self.grads, self.shapes)]
        if self.layer.form.captures:
            return grads
        if self.layer.form.whole_call:
            return list(zip(grads, self.layer.out_dims))
        return grads[0].movedim(self.layer.out_dims[0], 0)

    def batch(self) -> int:
        """Its number of examples."""
        form, b = self.layer.form, self.output_grads()
        if form.captures:
            return self.inputs.batch
        if form.whole_call:  # from an output with a batch dim (an RNN's h_n when packed)
            return next(g.shape[d] for g, d in b if isinstance(d, int))
        return b.shape[0]


def _direct(m: nn.Module, p: nn.Parameter) -> str | None:
    return next((n for n, q in m.named_parameters(recurse=False, remove_duplicate=False) if q is p), None)


def _dotted(m: nn.Module, p: nn.Parameter) -> str | None:
    return next((n for n, q in m.named_parameters(remove_duplicate=False) if q is p), None)


def _leaves(dims) -> list:
    return [d for d in pytree.tree_leaves(dims)]


def _local(m: nn.Module, p: nn.Parameter) -> str | None:
    """``p``'s name in ``m`` where ``m``'s form answers for it: held directly, or by a child
    whose weight ``m``'s forward uses itself (attention's ``out_proj.weight``)."""
    return _direct(m, p) or (_dotted(m, p) if form_of(m).captures else None)


def _closed(m: nn.Module, p: nn.Parameter, trace: Trace) -> bool:
    """``m`` holds ``p``, has a closed form, and its calls' batch dims are known."""
    dims = trace.dims.get(id(m), UNKNOWN)
    if _local(m, p) is None or form_of(m) is FUNC or dims == UNKNOWN:
        return False
    ins, outs = cast(tuple, dims)
    first = next(iter(_leaves(ins)), None)
    packed = form_of(m).takes_packed  # an RNN's PackedSequence in and out: the form splits it
    return (
        (isinstance(first, int) or (packed and first == PACKED))
        and bool(outs)
        and all(isinstance(d, int) or (packed and d == PACKED) for d in outs)
    )


def _one_row(m: nn.Module, p: nn.Parameter, trace: Trace) -> bool:
    """``m`` holds ``p``, has a closed form, and is called without the batch on one row
    (``[1, ...]`` in, ``[1, ...]`` out: HF's default position ids), which the stage can expand."""
    dims, first = trace.dims.get(id(m), UNKNOWN), trace.first.get(id(m))
    form = form_of(m)
    if _direct(m, p) is None or form is FUNC or form.whole_call or form.captures or dims == UNKNOWN or first is None:
        return False
    ins, outs = cast(tuple, dims)
    shapes = [s for s in pytree.tree_leaves(first.spec, is_leaf=lambda x: isinstance(x, torch.Size)) if s is not None]
    return (
        all(d is None for d in _leaves(ins))
        and outs == [None]
        and bool(shapes)
        and len(shapes[0]) > 0
        and shapes[0][0] == 1
        and len(first.outs[0]) > 0
        and first.outs[0][0] == 1
    )


def _rows(m: nn.Module, trace: Trace) -> tuple[int, ...]:
    """The outputs of ``m``'s calls without the batch but with one leading row (T5's position
    bias, which later blocks add to their batched scores): the stage can expand those."""
    outs, first = cast(tuple, trace.dims[id(m)])[1], trace.first.get(id(m))
    return tuple(
        k
        for k, d in enumerate(outs)
        if d is None and first is not None and len(first.outs[k]) and first.outs[k][0] == 1
    )


def _general(m: nn.Module, trace: Trace, rows: bool = False) -> bool:
    """``m``'s calls split per example: every input's batch dim known, none an object of its own
    (a cache), every output batched (``rows``: or one row the stage expands, beside a batched one)."""
    dims, first = trace.dims.get(id(m), UNKNOWN), trace.first.get(id(m))
    if dims == UNKNOWN or (first is not None and first.opaque):
        return False
    ins, outs = cast(tuple, dims)
    leaves = _leaves(ins)
    expandable = _rows(m, trace) if rows else ()
    return (
        UNKNOWN not in leaves
        and PACKED not in leaves  # torch.func cannot split a PackedSequence per example
        and any(isinstance(d, int) for d in leaves)
        and any(isinstance(d, int) for d in outs)
        and all(isinstance(d, int) or k in expandable for k, d in enumerate(outs))
    )


def _cover(p: nn.Parameter, uses: list[tuple], trace: Trace, rows: bool) -> nn.Module | None:
    """The deepest module running during every use of ``p`` that holds it and splits per example."""
    common = [m for m in uses[0] if all(any(m is u for u in stack) for stack in uses[1:])]
    return next((m for m in reversed(common) if _dotted(m, p) is not None and _general(m, trace, rows)), None)


def assign(model: nn.Module, trace: Trace, params: dict[str, nn.Parameter], broadcast: bool = True) -> list[Layer]:
    """The layers answering for ``params`` (name -> parameter). Unused parameters get
    none (a gradient for one is refused at the backward that brings it). ``broadcast``:
    closed-form layers called on one row without the batch are followed with their output
    expanded to the batch (the caller checks that the model's outputs stay the same)."""
    modules = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    layers: dict[tuple[int, bool], Layer] = {}
    for name, p in params.items():
        uses = trace.uses.get(id(p))
        if not uses:
            continue
        inner = list({id(s[-1]): s[-1] for s in uses}.values())
        if all(_closed(m, p, trace) for m in inner):
            for m in inner:
                _layer(layers, m, form_of(m), trace, False).names[cast(str, _local(m, p))] = p
            continue
        if broadcast and all(_closed(m, p, trace) or _one_row(m, p, trace) for m in inner):
            for m in inner:
                layer = _layer(layers, m, form_of(m), trace, False)
                layer.names[_direct(m, p)] = p
                if not _closed(m, p, trace):  # the batch's dim 0 once expanded
                    first = trace.first[id(m)].spec
                    layer.in_dims = pytree.tree_map(lambda s: 0 if isinstance(s, torch.Size) else None, first,
                                                    is_leaf=lambda x: isinstance(x, torch.Size))  # fmt: skip
                    layer.out_dims, layer.broadcast = [0], True
            continue
        m = _cover(p, uses, trace, broadcast)
        if m is None:
            users = ", ".join(sorted({modules.get(id(s[-1]), "?") or type(model).__name__ for s in uses}))
            raise ValueError(
                f"per_sample: {name!r} (used by {users}) has no module whose forward covers every use "
                "and whose outputs all carry the batch, so its per-example gradient cannot be known; "
                "use it inside one module's forward, or leave it out of the rule"
            )
        layer = _layer(layers, m, FUNC, trace, True)
        layer.names[_dotted(m, p)] = p
        if not _general(m, trace):  # its one-row outputs expanded to the batch
            layer.rows, layer.broadcast = _rows(m, trace), True
            layer.out_dims = [0 if k in layer.rows else d for k, d in enumerate(layer.out_dims)]
    out = list(layers.values())
    held: dict[int, int] = {}
    for layer in out:
        for p in layer.names.values():
            held[id(p)] = held.get(id(p), 0) + 1
    for layer in out:
        layer.materialise = any(held[id(p)] > 1 for p in layer.names.values())
    return out


def _layer(layers: dict, m: nn.Module, form: Form, trace: Trace, general: bool) -> Layer:
    key = (id(m), general)
    if key not in layers:
        ins, outs = trace.dims[id(m)]
        layers[key] = Layer(m, form, {}, ins, outs)
    return layers[key]


def path_of(layer: Layer, where: str) -> str:
    """How the stage gets a layer's per-example gradients, as the plan names it: ``closed
    form`` (per-example weights from the call's input and output gradient), ``Gram`` (norms
    without them: Gram matrices or ``|a_i||b_i|``, the clipped sum as one matmul), ``replay``
    (an RNN's recurrence replayed once), ``general`` (torch.func over ``where``: the slow path)."""
    from gradmod.hooks.per_sample.forms.layers import RNNForm
    from gradmod.hooks.per_sample.forms.replay import FuncForm

    if isinstance(layer.form, FuncForm):
        path = f"general: torch.func over {where}"
    elif isinstance(layer.form, RNNForm):
        path = "replay"
    else:
        path = "Gram" if layer.materialised is False else "closed form"
    return path + (", one row expanded to the batch" if layer.broadcast else "")


def paths_of(model: nn.Module, layers: list[Layer], names: dict[int, str]) -> dict[str, str]:
    """Each parameter's path (``path_of``) by its name (``names``: id -> name)."""
    where = {id(m): n or type(model).__name__ for n, m in model.named_modules()}
    return {names[id(p)]: path_of(x, where[id(x.module)]) for x in layers for p in x.names.values()}
