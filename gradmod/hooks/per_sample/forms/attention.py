"""The per-example form of ``nn.MultiheadAttention``: its projections in closed form.

Its weights are used functionally: ``F.multi_head_attention_forward`` calls ``F.linear`` on
``in_proj_weight`` (whole, or its q, k and v rows), ``q/k/v_proj_weight`` and
``out_proj.weight``, never a Linear's forward. While the module runs, a torch-function mode
records each of those calls: its input, which rows of which parameter it used, and its output,
whose gradient then arrives like a layer's output gradient. Each call is a Linear on a
sequence, so each example's gradient of a parameter is the sum over its calls (disjoint rows)
of ``b_i^T a_i``: no replay of the module, and attention's dropout is the batch's own. The
projections' inputs are ``[T, B, E]`` (or ``[T * B, E]``, time major, for the output
projection) inside torch's function, whatever the module's ``batch_first``.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from gradmod.hooks.per_sample.detached_weights import in_graph, restore, swap
from gradmod.hooks.per_sample.forms.base import Form

MATERIALISE_MAX = 1 << 24  # as the Linear's: elements of [B, *param] worth keeping


def _undispatched(fn):
    """A copy of torch's Python function ``fn`` whose ``__torch_function__`` check says no, so a
    mode sees the operations inside it (torch's own function is left as it is)."""
    namespace = dict(fn.__globals__)
    for name in ("has_torch_function", "has_torch_function_unary", "has_torch_function_variadic"):
        namespace[name] = lambda *_: False
    copy = types.FunctionType(fn.__code__, namespace, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    return copy


_MHA_FORWARD = _undispatched(F.multi_head_attention_forward)


@dataclass
class Projection:
    """One ``F.linear`` call on the module's parameters: its input as torch's function gave it
    (``[N, B, in]``, or ``[N * B, in]`` time major), and the first row of each parameter (local
    name) it used."""

    x: Tensor
    batch: int
    rows: dict[str, int]

    @property
    def a(self) -> Tensor:
        """The input, batch first ``[B, N, in]`` (a view)."""
        return _batch_first(self.x, self.batch)


def _batch_first(t: Tensor, bsz: int) -> Tensor:
    return t.view(-1, bsz, t.shape[-1]).transpose(0, 1) if t.dim() == 2 else t.transpose(0, 1)


@dataclass
class Projections:
    """One call of the module: its batch and the projections it ran."""

    batch: int
    calls: list[Projection] = field(default_factory=list)


class _Record(TorchFunctionMode):
    """Each ``F.linear`` on a watched parameter (or rows of one) while the module runs."""

    def __init__(self, params: dict[str, Tensor], dtype: torch.dtype):
        super().__init__()
        self.params, self.dtype = params, dtype
        self.found: Projections | None = None
        self.outs: list[Tensor] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.multi_head_attention_forward and self.found is None:
            query = args[0] if args else kwargs["query"]
            self.found = Projections(query.shape[1] if query.dim() == 3 else 0)
            with self:  # torch's function, its operations seen by this mode
                return _MHA_FORWARD(*args, **kwargs)
        # (a torch whose function dispatches again lands here: nothing is recorded, and the first
        # backward's check refuses the parameters in one line)
        if func is not F.linear or self.found is None or not self.found.batch:
            return func(*args, **kwargs)
        x, w, bias = [*args, *(kwargs.get(k) for k in ("input", "weight", "bias")[len(args) :])][:3]
        rows = {n: r for n, r in (_rows(t, self.params) for t in (w, bias) if t is not None) if n is not None}
        if rows and not w.requires_grad and x.dim() > 2 and not x.is_contiguous():
            # a detached weight makes matmul broadcast it over a strided input (a copy per row): fold instead
            x = x.contiguous()
        out = F.linear(x, w, bias)
        if rows and not w.requires_grad:  # a detached weight on data: its output takes a gradient still
            out = in_graph(out) if in_graph(out) is not None else out
        if rows and isinstance(out, Tensor) and out.requires_grad:
            x = x.detach()
            x = x.to(self.dtype) if x.is_floating_point() and x.dtype != self.dtype else x
            self.found.calls.append(Projection(x, self.found.batch, rows))
            self.outs.append(out)
        return out


def _rows(t: Tensor, params: dict[str, Tensor]) -> tuple[str | None, int]:
    """The parameter ``t`` is, or whose whole rows it views (``in_proj_weight.chunk(3)``), and its first row."""
    for name, p in params.items():
        if t is p:
            return name, 0
        if t._base is p and t.dim() == p.dim() and t.stride() == p.stride() and t.shape[1:] == p.shape[1:]:
            offset = t.storage_offset() - p.storage_offset()
            if offset % p.stride(0) == 0:
                return name, offset // p.stride(0)
    return None, 0


def _grads(c: Projection, g: Tensor) -> Tensor:
    """The output gradient of a projection, batch first ``[B, N, out]``."""
    return _batch_first(g, c.batch)


def _gram_pays(c: Projection, g: Tensor) -> bool:
    """Gram matrices (``T^2 (in + out)``) cost no more than the per-example weight (``T in out``)."""
    t, d_in, d_out = c.a.shape[1], c.a.shape[2], g.shape[-1]
    return t * (d_in + d_out) <= d_in * d_out


def _weight(name: str) -> bool:
    return name.endswith("weight")


def _disjoint(proj: Projections, b: list[Tensor], name: str) -> bool:
    """The calls that used ``name`` used different rows of it (torch's q, k, v chunks)."""
    spans = sorted((c.rows[name], c.rows[name] + g.shape[-1]) for c, g in zip(proj.calls, b) if name in c.rows)
    return all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))


class AttentionForm(Form):
    """``nn.MultiheadAttention`` (without ``bias_k``/``bias_v``): every projection a Linear on
    a sequence, recorded as the module runs (``record``)."""

    captures = True  # its calls are recorded inside the module's forward; it answers for children's params

    def applies(self, m: nn.Module) -> bool:
        return getattr(m, "bias_k", None) is None and getattr(m, "bias_v", None) is None

    def record(self, m: nn.Module, names: dict[str, Tensor], dtype: torch.dtype) -> _Record:
        return _Record(names, dtype)

    @staticmethod
    def _pairs(proj: Projections, b: list[Tensor], name: str):
        for c, g in zip(proj.calls, b):
            if name in c.rows:
                yield c, _grads(c, g), c.rows[name]

    def materialises(self, m, a: Projections, b):
        """Per-example weights only where some projection's Gram matrices would cost more."""
        grams = all(_gram_pays(c, g) for c, g in zip(a.calls, b))
        return not grams and a.batch * sum(p.numel() for p in m.parameters()) <= MATERIALISE_MAX

    def per_example(self, m, a: Projections, b: list[Tensor], names):
        out = {}
        for n in names:
            p = m.get_parameter(n)
            full = None
            for c, g, r in self._pairs(a, b, n):
                part = torch.bmm(g.mT, c.a) if _weight(n) else g.sum(1)
                if full is None and r == 0 and part.shape[1] == p.shape[0]:
                    full = part
                    continue
                if full is None:
                    full = part.new_zeros(a.batch, *p.shape)
                full[:, r : r + part.shape[1]] += part
            out[n] = full if full is not None else torch.zeros(a.batch, *p.shape, dtype=p.dtype, device=p.device)
        return out

    def norms2(self, m, a: Projections, b: list[Tensor], names):
        out = {}
        for n in names:
            if not _disjoint(a, b, n):
                out[n] = self.per_example(m, a, b, {n})[n].flatten(1).square().sum(1)
                continue
            total = None
            for c, g, _ in self._pairs(a, b, n):
                if not _weight(n):
                    v = g.sum(1).square().sum(1)
                elif _gram_pays(c, g):
                    v = (torch.bmm(c.a, c.a.mT) * torch.bmm(g, g.mT)).sum((1, 2))
                else:
                    v = torch.bmm(g.mT, c.a).square().sum((1, 2))
                total = v if total is None else total + v
            out[n] = total if total is not None else b[0].new_zeros(a.batch)
        return out

    def weighted(self, m, a: Projections, b: list[Tensor], w: Tensor, names):
        out = {}
        for n in names:
            p = m.get_parameter(n)
            acc = torch.zeros(p.shape, dtype=b[0].dtype if b else p.dtype, device=p.device)
            for c, g in zip(a.calls, b):
                if n not in c.rows:
                    continue
                r, wt = c.rows[n], w.to(g.dtype).view(1, -1, 1)
                # in torch's own layout (batch in dim 1 of [N, B, .]): the narrower side weighted
                g3, x3 = g.reshape(-1, c.batch, g.shape[-1]), c.x.reshape(-1, c.batch, c.x.shape[-1])
                if not _weight(n):
                    part = wt.view(-1) @ g3.sum(0)
                elif x3.shape[-1] <= g3.shape[-1]:
                    part = torch.mm((x3 * wt).flatten(0, 1).T, g3.flatten(0, 1)).T
                else:
                    part = torch.mm((g3 * wt).flatten(0, 1).T, x3.flatten(0, 1))
                acc[r : r + part.shape[0]] += part
            out[n] = acc
        return out


def probe(m, a: Projections, b: list[Tensor], probes: dict, names) -> dict[str, Tensor]:
    """``sum_i <g_i, R>`` along each parameter's probe (``R = u v^T`` for a weight; ``r`` for a
    bias): per call ``sum_t (u_rows . b_t)(v . a_t)``, the rows the call used."""
    out = {}
    for n in names:
        total = None
        for c, g in zip(a.calls, b):  # input and output gradient in the same layout: no reordering
            if n not in c.rows:
                continue
            r = c.rows[n]
            if _weight(n):
                u, v = probes[n]
                d = ((g @ u[r : r + g.shape[-1]].to(g.dtype)) * (c.x @ v.to(c.x.dtype))).sum()
            else:
                d = (g @ probes[n][0][r : r + g.shape[-1]].to(g.dtype)).sum()
            total = d if total is None else total + d
        if total is not None:
            out[n] = total
    return out


def follow(m: nn.Module, form: AttentionForm, names: dict[str, Tensor], active, done, detach) -> list:
    """Hooks that record each call of ``m`` while ``active()``: ``done(found, outputs)`` gets its
    projections and their output tensors (whose gradients the caller hooks). The parameters in
    ``detach()`` (ids; after the first backward) run as detached aliases (``detached_weights``)."""
    dtype = next(iter(names.values())).dtype
    open_: list[tuple[_Record, list]] = []

    def close() -> _Record:
        mode, swapped = open_.pop()
        mode.__exit__(None, None, None)
        restore(swapped)
        return mode

    def pre(module, args, kwargs):
        while open_:  # a forward that raised left its recording open
            close()
        if active():
            params, swapped = swap(module, names, detach())
            mode = form.record(module, params, dtype)
            mode.__enter__()
            open_.append((mode, swapped))

    def post(module, args, kwargs, output):  # also when the forward raised (output None)
        if open_:
            mode = close()
            if output is not None and mode.found is not None and mode.found.calls:
                done(mode.found, mode.outs)

    post_hook = m.register_forward_hook(post, with_kwargs=True, always_call=True)
    return [m.register_forward_pre_hook(pre, with_kwargs=True), post_hook]
