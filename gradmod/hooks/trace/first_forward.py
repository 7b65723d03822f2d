"""What a stage learns from the model's first training forward, before it runs: which module
calls use each parameter (the per_sample stage, and the per_loss stage's ``param_uses``).

Two extra forwards of the same inputs (the random state restored after them): one with the
batch as given, recording for every parameter of a per_sample rule the modules whose
forwards were running when an operation used it; one with the batch grown by one example.
A tensor dimension whose size changed with the batch is that call's batch dimension: known,
not guessed from sizes (a sequence as long as the batch is large stays put). A dimension
that holds the batch merged with another, or two that both changed, is marked ``UNKNOWN``.
The first forward also notes every random operation (dropout) and the modules running it,
and every module call that gets or gives a ``PackedSequence``: the stage refuses both where
it cannot split them per example.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from gradmod.hooks.trace.held import HeldTrainable
from gradmod.hooks.trace.output_leaves import PLAIN, alike, kept

UNKNOWN = "?"
PACKED = "packed"  # a PackedSequence where a tensor's shape would be
# Operations that draw random numbers whatever their arguments (dropout-like ones are checked apart).
RANDOM = {
    "bernoulli", "bernoulli_", "rand", "rand_like", "randn", "randn_like", "randint", "randint_like",
    "randperm", "multinomial", "normal", "normal_", "uniform_", "exponential_", "geometric_",
    "log_normal_", "cauchy_", "random_", "poisson",
}  # fmt: skip


@dataclass
class CallShapes:
    """One module call: the shapes of its tensor inputs (the ``(args, kwargs)`` tree) and outputs."""

    spec: Any  # the (args, kwargs) tree with each tensor leaf replaced by its shape, else None
    outs: list[torch.Size] = field(default_factory=list)
    opaque: bool = False  # an input that is an object of its own (a key/value cache): no replay can reuse it


@dataclass
class Trace:
    batch: int
    dims: dict[int, tuple[Any, list]]  # id(module) -> (input dims tree, output dims) or UNKNOWN
    uses: dict[int, list[tuple[nn.Module, ...]]]  # id(param) -> each use's stack of running modules
    random: list[tuple[str, float, tuple[nn.Module, ...]]] = field(default_factory=list)  # (op, p, stack)
    packed: list[nn.Module] = field(default_factory=list)  # modules called with or giving a PackedSequence
    outs: list[torch.Size] = field(default_factory=list)  # the shapes of the model's own outputs
    first: dict[int, CallShapes] = field(default_factory=dict)  # id(module) -> its first call's shapes
    output: Any = None  # the model's output (detached), to compare a changed forward with
    rng: Any = None  # the random state the first forward started from
    asked: dict = field(default_factory=dict)  # the forward's requires_grad switches, held (``held.settle``)


class TraceError(ValueError):
    """The model's forward cannot be traced as the stage needs (one line)."""


def is_packed(x: Any) -> bool:
    """A PackedSequence: a pytree leaf here (its data carries the examples' steps)."""
    return isinstance(x, PackedSequence)


def _carried(x: Any) -> bool:
    """A tensor, or a PackedSequence taken whole (its data carries the gradient)."""
    return isinstance(x, (Tensor, PackedSequence))


def _shape(x: Any) -> Any:
    if isinstance(x, PackedSequence):
        return PACKED
    return x.shape if isinstance(x, Tensor) else None


def _dropout_p(func, args: tuple, kwargs: dict) -> float:
    """The probability a random operation zeroes with (1.0: it draws whatever it does); 0: none."""
    name = getattr(func, "__name__", "")
    if name in RANDOM:
        return 1.0
    if "dropout" not in name and name not in (
        "scaled_dot_product_attention",
        "multi_head_attention_forward",
        "rrelu",
        "rrelu_",
    ):
        return 0.0
    try:
        bound = inspect.signature(func).bind(*args, **kwargs)
        bound.apply_defaults()
        given = dict(bound.arguments)
    except (TypeError, ValueError):  # a builtin: torch.dropout(input, p, train), sdpa(q, k, v, mask, dropout_p)
        order = ["input", "p", "train"] if "dropout" in name else ["query", "key", "value", "attn_mask", "dropout_p"]
        given = {**dict(zip(order, args)), **kwargs}
    if name.startswith("rrelu"):  # random in training only
        return 1.0 if given.get("training", False) else 0.0
    if not given.get("training", given.get("train", True)):
        return 0.0
    p = given.get("dropout_p", given.get("p", 0.0))
    return float(p) if isinstance(p, (int, float)) else 1.0


def _tensors(out: Any) -> list[Tensor]:
    return [t for t in pytree.tree_leaves(out) if isinstance(t, Tensor)]


class _Uses(TorchFunctionMode):
    """Each operation that takes a watched parameter and gives a tensor autograd connects to it."""

    def __init__(self, watched: set[int], stack: list, uses: dict, random: list):
        super().__init__()
        self.watched, self.stack, self.uses, self.random = watched, stack, uses, random

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        drop = _dropout_p(func, args, kwargs or {})
        if drop > 0:
            self.random.append((getattr(func, "__name__", str(func)), drop, tuple(self.stack)))
        used = {id(x) for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, Tensor)} & self.watched
        if used and any(t.grad_fn is not None for t in _tensors(out)):
            for p in used:
                self.uses.setdefault(p, []).append(tuple(self.stack))
        return out


def _record(model: nn.Module, args, kwargs, watched: set[int] | None, trace: Trace | None = None):
    calls: dict[int, list[CallShapes]] = {}
    stack: list[nn.Module] = []
    open_calls: list[CallShapes] = []
    uses: dict[int, list] = {} if trace is None else trace.uses
    random: list = [] if trace is None else trace.random
    packed: list = [] if trace is None else trace.packed

    def pre(m, a, kw):
        stack.append(m)
        if any(is_packed(x) for x in pytree.tree_leaves((a, kw), is_leaf=is_packed)):
            packed.append(m)
        call = CallShapes(pytree.tree_map(_shape, (a, kw), is_leaf=is_packed))
        call.opaque = not all(isinstance(x, PLAIN) for x in pytree.tree_leaves((a, kw), is_leaf=is_packed))
        calls.setdefault(id(m), []).append(call)
        open_calls.append(call)

    def post(m, a, kw, out):
        stack.pop()
        if any(is_packed(x) for x in pytree.tree_leaves(out, is_leaf=is_packed)) and m not in packed:
            packed.append(m)
        open_calls.pop().outs = [_shape(x) for x in pytree.tree_leaves(out, is_leaf=is_packed) if _carried(x)]

    modules = {id(m): m for m in model.modules()}.values()
    handles = [
        h
        for m in modules
        for h in (m.register_forward_pre_hook(pre, with_kwargs=True), m.register_forward_hook(post, with_kwargs=True))
    ]
    try:
        if watched is None:
            with torch.no_grad():
                model(*args, **kwargs)
        else:
            with torch.enable_grad(), _Uses(watched, stack, uses, random):
                output = model(*args, **kwargs)
            if trace is not None:
                trace.output = pytree.tree_map(kept, output)
    finally:
        for h in handles:
            h.remove()
    return calls


def _dim(a: torch.Size | None, b: torch.Size | None, batch: int):
    if a == PACKED or b == PACKED:  # the examples are the packed sequences
        return PACKED if a == b else UNKNOWN
    if a is None:
        return None
    if b is None or len(a) != len(b):
        return UNKNOWN
    changed = [d for d in range(len(a)) if a[d] != b[d]]
    if not changed:
        return None
    d = changed[0]
    return d if len(changed) == 1 and a[d] == batch and b[d] == batch + 1 else UNKNOWN


def _dims(first: list[CallShapes], grown: list[CallShapes] | None, batch: int):
    """One module's dims, the same for all its calls, else UNKNOWN."""
    if grown is None or len(first) != len(grown):
        return UNKNOWN
    found = []
    for c1, c2 in zip(first, grown):
        leaves1, tree1 = pytree.tree_flatten(c1.spec, is_leaf=lambda x: isinstance(x, torch.Size) or x == PACKED)
        leaves2, tree2 = pytree.tree_flatten(c2.spec, is_leaf=lambda x: isinstance(x, torch.Size) or x == PACKED)
        if tree1 != tree2 or len(c1.outs) != len(c2.outs):
            return UNKNOWN
        ins = pytree.tree_unflatten([_dim(x, y, batch) for x, y in zip(leaves1, leaves2)], tree1)
        found.append((ins, [_dim(x, y, batch) for x, y in zip(c1.outs, c2.outs)]))
    return found[0] if all(f == found[0] for f in found) else UNKNOWN


def batch_dim(model: nn.Module, declared: int | None = None) -> int:
    """The batch dimension of the model's own inputs: ``declared`` (``attach(batch_dim=...)``),
    else 0, or 1 for a model that says ``batch_first = False`` as torch's sequence layers do."""
    if declared is not None:
        return declared
    return 1 if getattr(model, "batch_first", True) is False else 0


def batch_size(model: nn.Module, args: tuple, kwargs: dict, declared: int | None = None) -> int | None:
    """The size of the batch dimension of the model's first input that has one (None: none has)."""
    d = batch_dim(model, declared)
    leaves = pytree.tree_leaves((args, kwargs), is_leaf=is_packed)
    first = next((x for x in leaves if is_packed(x) or (isinstance(x, Tensor) and x.dim() > d)), None)
    if isinstance(first, PackedSequence):
        return int(first.batch_sizes[0]) if len(first.batch_sizes) else 0
    return None if first is None else first.shape[d]


def _grow(x: Any, d: int, batch: int) -> Any:
    """``x`` with its first example twice (in front: sorted sequence lengths stay sorted)."""
    if isinstance(x, PackedSequence):
        padded, lengths = pad_packed_sequence(x, batch_first=True)
        padded, lengths = torch.cat([padded[:1], padded]), torch.cat([lengths[:1], lengths])
        return pack_padded_sequence(padded, lengths, batch_first=True, enforce_sorted=x.sorted_indices is None)
    if isinstance(x, Tensor) and x.dim() > d and x.shape[d] == batch:
        return torch.cat([x.narrow(d, 0, 1), x], d)
    return x


def _first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def trace(model: nn.Module, args: tuple, kwargs: dict, watched: set[int], declared: int | None = None) -> Trace | None:
    """The trace of one forward of ``model(*args, **kwargs)``; None when no input has a batch."""
    d = batch_dim(model, declared)
    batch = batch_size(model, args, kwargs, declared)
    if batch is None:
        return None
    out = Trace(batch, {}, {})
    devices = [x.device for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, Tensor) and x.is_cuda]
    cuda = sorted({x.index or 0 for x in devices})
    with torch.random.fork_rng(devices=cuda), HeldTrainable(watched) as held:
        out.rng = (torch.get_rng_state(), {i: torch.cuda.get_rng_state(i) for i in cuda})
        calls = _record(model, args, kwargs, watched, out)
        grown_args, grown_kwargs = pytree.tree_map(lambda x: _grow(x, d, batch), (args, kwargs), is_leaf=is_packed)
        try:
            grown = _record(model, grown_args, grown_kwargs, None)
        except Exception as e:  # the user's model: any error it raises on a batch one larger
            raise TraceError(
                f"per_sample: {type(model).__name__}'s forward fails on its inputs with the batch (dim {d}) "
                f"grown by one example ({_first_line(e)}); the stage runs it so to find each call's batch "
                "dimension: declare the inputs' batch dimension with attach(batch_dim=...), or make the "
                "forward take any batch size"
            ) from None
    out.asked = held.asked
    out.dims = {m: _dims(c, grown.get(m), batch) for m, c in calls.items()}
    out.outs = calls[id(model)][0].outs
    out.first = {m: c[0] for m, c in calls.items()}
    return out


def expand_rows(output: Any, rows: tuple[int, ...] | None, batch: int) -> Any:
    """``output`` with its one-row tensors expanded to ``batch``: ``rows`` the indices of those
    among its tensor leaves (None: the output is that one tensor)."""
    if rows is None:
        return output.expand(batch, *output.shape[1:])
    leaves, spec = pytree.tree_flatten(output)
    tensors = [i for i, x in enumerate(leaves) if isinstance(x, Tensor)]
    for k in rows:
        x = leaves[tensors[k]]
        leaves[tensors[k]] = x.expand(batch, *x.shape[1:])
    return pytree.tree_unflatten(leaves, spec)


def _expanded(batch: int, rows: tuple[int, ...] | None):
    def hook(m, args, output):
        return expand_rows(output, rows, batch)

    return hook


def broadcasts_alike(model: nn.Module, args: tuple, kwargs: dict, modules: list[tuple], trace: Trace) -> bool:
    """Whether the model's forward gives the very same outputs when each of ``modules``
    (module, ``rows`` as ``expand_rows`` takes them) returns its one-row outputs (no batch in
    its inputs: HF's default position ids, T5's position bias) expanded to the batch, as the
    stage will then do so to see each example's share of their gradient (``same_output``)."""
    handles = [m.register_forward_hook(_expanded(trace.batch, rows)) for m, rows in modules]
    try:
        return same_output(model, args, kwargs, trace)
    finally:
        for h in handles:
            h.remove()


def same_output(model: nn.Module, args: tuple, kwargs: dict, trace: Trace) -> bool:
    """Whether the model's forward, run as the traced one ran (from its random state: the same
    dropout masks; gradients on: some layers, an LSTM, pick other kernels without), gives the
    very same outputs as the trace's."""
    cpu, cuda = trace.rng
    try:
        with torch.random.fork_rng(devices=list(cuda)), torch.enable_grad():  # the first's kernels too
            torch.set_rng_state(cpu)
            for i, state in cuda.items():
                torch.cuda.set_rng_state(state, i)
            output = model(*args, **kwargs)
    except Exception:  # a consumer that needs the one row (its shape): not alike
        return False
    mine, theirs = [kept(x) for x in pytree.tree_leaves(output)], pytree.tree_leaves(trace.output)
    return len(mine) == len(theirs) and all(alike(a, b) for a, b in zip(mine, theirs))


def param_uses(
    model: nn.Module, args: tuple, kwargs: dict, watched: set[int]
) -> dict[int, list[tuple[nn.Module, ...]]]:
    """id(param) -> the stack of running modules at each use of a ``watched`` parameter, from
    one forward of ``model(*args, **kwargs)``; the random state and the buffers (BatchNorm's
    running statistics) are as they were before it, and the inputs untouched."""
    devices = [x.device for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, Tensor) and x.is_cuda]
    # Buffers by where they are held: a forward may set one anew (``self.n = self.n + 1``).
    buffers = [(m, n, b, b.detach().clone()) for m in model.modules() for n, b in m._buffers.items() if b is not None]
    # Copies of the inputs: a forward may change its input in place (``x /= 255``).
    args, kwargs = pytree.tree_map(_copy_input, (args, kwargs), is_leaf=is_packed)
    with torch.random.fork_rng(devices=sorted({x.index or 0 for x in devices})):
        try:
            found = Trace(batch=0, dims={}, uses={})
            _record(model, args, kwargs, watched, found)
            uses = found.uses
        finally:
            with torch.no_grad():
                for m, n, b, saved in buffers:
                    m._buffers[n] = b
                    b.copy_(saved)
    return uses


def _copy_input(x: Any) -> Any:
    if isinstance(x, PackedSequence):
        return x._replace(data=x.data.clone())
    return x.clone() if isinstance(x, Tensor) else x


def detach_input(x: Any, dtype: torch.dtype | None = None) -> Any:
    """``x`` out of the graph; a floating tensor in ``dtype`` (autocast's bf16 inputs); a
    PackedSequence's data so, its steps' sizes and order kept."""
    if isinstance(x, PackedSequence):
        return x._replace(data=detach_input(x.data, dtype))
    if not isinstance(x, Tensor):
        return x
    x = x.detach()
    return x.to(dtype) if dtype is not None and x.is_floating_point() and x.dtype != dtype else x


def param_or_none(model: nn.Module, name: str) -> Tensor | None:
    try:
        return model.get_parameter(name)
    except AttributeError:
        return None


def followed_forward() -> bool:
    """A forward worth following: gradients on, and no torch.func transform (ours replaying
    a module, or the user's) running it."""
    return torch.is_grad_enabled() and not torch._C._are_functorch_transforms_active()
