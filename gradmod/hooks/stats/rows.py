"""The ``log`` statistics of many gradients in few passes over them.

``stat_rows(tensors)`` gives each tensor's row (``GradStats.FIELDS``): L2 norm, min, max,
mean, fraction of negative entries, non-finite count, and, for a ``post`` observer, the
fraction of entries the transforms since its ``pre`` partner changed.

How the work is split, so the cost follows the arithmetic and not the tensor count:

* a tensor of ``BIG`` entries or more is reduced alone (viewed as one row), a handful of
  passes over it; at the hook stage this runs in the tensor's hook, while it is in cache;
* smaller tensors of one shape are stacked into a ``[k, n]`` matrix and reduced along its
  rows: a few ops for all of them;
* a small tensor alone in its shape joins one flat buffer reduced per segment.

A row depends only on its tensor and on which tensors share the call (a row reduction of
fewer than ``BIG`` entries is one thread's, whatever the matrix; a segment's, wherever it
lies), so the hook stage (rows per rule and chain position, at the end of backward) and the
fused stage (per rule and step) give the same bits. A ``pre`` and ``post`` pair of one call
splits by the ``pre`` tensors, so computing the two together or apart is the same too.
On CUDA nothing is read back to the host; on the CPU, where a read is free, one value says
whether the non-finite counts need their passes at all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from gradmod.hooks.mesh.devices import loops_foreach, reads_free

# Entries from which a tensor is reduced alone; ATen's parallel grain (32768), so a row
# reduction of a smaller tensor runs on one thread whatever the matrix around it.
BIG = 1 << 15
_LAYOUTS: dict[tuple, Layout] = {}


@dataclass
class Layout:
    """How one layout (the tensors' shapes, in order; ``copies`` 2 for pre and post) splits."""

    groups: list[list[int]]  # indices of same-shape small tensors, two or more each
    singles: list[int]  # small tensors alone in their shape (or empty)
    bigs: list[int]
    copies: int
    order: list[int]  # tensor index of each output row
    lengths: Tensor  # the singles' sizes, per copy (segment lengths)
    divisor: Tensor  # [rows, 7]: turns sums into means and fractions
    zeros: list[Tensor]  # per part, a zero column for an unpaired frac_clipped


def layout(tensors: list[Tensor], copies: int = 1) -> Layout:
    """The split of ``tensors`` (the first of ``copies`` equal-shaped lists), built once per layout."""
    key = (tuple(tuple(t.shape) for t in tensors), tensors[0].device, copies)
    cached = _LAYOUTS.get(key)
    if cached is not None:
        return cached
    shapes: dict[tuple, list[int]] = {}
    bigs = []
    for i, t in enumerate(tensors):
        if t.numel() >= BIG:
            bigs.append(i)
        else:  # an empty gradient keeps to itself: a segment of length 0
            shapes.setdefault(tuple(t.shape) if t.numel() else ("empty", i), []).append(i)
    groups = [ix for ix in shapes.values() if len(ix) > 1]
    singles = [ix[0] for ix in shapes.values() if len(ix) == 1]
    n, device = len(tensors), tensors[0].device
    rep = [[i + c * n for c in range(copies) for i in ix] for ix in groups]
    order = (
        [i for ix in rep for i in ix]
        + [i + c * n for c in range(copies) for i in singles]
        + [i + c * n for i in bigs for c in range(copies)]
    )
    sizes = torch.tensor([float(tensors[i % n].numel()) for i in order], device=device)
    one = torch.ones_like(sizes)
    parts = [len(ix) for ix in rep] + ([copies * len(singles)] if singles else []) + [1] * (copies * len(bigs))
    out = Layout(
        groups,
        singles,
        bigs,
        copies,
        order,
        torch.tensor([tensors[i].numel() for i in singles] * copies, device=device),
        torch.stack([one, one, one, sizes, sizes, one, sizes], 1),  # mean, negatives/n, changed/n
        [torch.zeros(k, device=device) for k in parts],
    )
    if len(_LAYOUTS) > 256:  # layouts change only with module outputs' batch sizes
        _LAYOUTS.clear()
    _LAYOUTS[key] = out
    return out


@dataclass
class Seen:
    """What a ``post`` partner compares with: a ``pre`` call's parts (copies of small tensors)."""

    parts: list[Tensor]


def _float(t: Tensor) -> Tensor:
    return t if t.dtype == torch.float32 else t.float()


def _flat(t: Tensor) -> Tensor:
    return t if t.dim() == 1 else t.reshape(-1)


def _parts(tensors: list[Tensor], lay: Layout) -> list[Tensor]:
    """Per group its [copies * k, n] matrix (a copy), the singles' flat buffer (a copy),
    each big tensor as [1, n] (a view), copies next to each other."""
    n = len(tensors) // lay.copies
    out = []
    for g in lay.groups:
        m = _float(torch.stack([tensors[i + c * n] for c in range(lay.copies) for i in g]))
        out.append(m if m.dim() == 2 else m.reshape(m.shape[0], -1))
    if lay.singles:
        out.append(_float(torch.cat([_flat(tensors[i + c * n]) for c in range(lay.copies) for i in lay.singles])))
    out.extend(_float(tensors[i + c * n]).reshape(1, -1) for i in lay.bigs for c in range(lay.copies))
    return out


# On the CPU, kernels that write bool tensors, sum them, or take fmax run several times slower
# than float ones: where it pays, comparisons write 0.0/1.0 into float buffers instead.
#
# CPU scratch buffers for big tensors' per-entry passes, kept from call to call: a fresh
# multi-megabyte buffer comes from the OS page by page (glibc returns freed big blocks), and
# its page faults cost more than the pass. Up to ``_SCRATCH_MAX`` entries; CUDA's caching
# allocator needs none.
_SCRATCH: dict[tuple[torch.dtype, int], Tensor] = {}
_SCRATCH_MAX = 1 << 24


def _scratch(like: Tensor, slot: int = 0) -> Tensor:
    """An uninitialized buffer of ``like``'s shape and dtype; ``slot``: several at once."""
    n = like.numel()
    if not loops_foreach(like.device) or n > _SCRATCH_MAX or not like.is_contiguous():
        return torch.empty_like(like)
    buf = _SCRATCH.get((like.dtype, slot))
    if buf is None or buf.numel() < n:
        buf = _SCRATCH[(like.dtype, slot)] = torch.empty(n, dtype=like.dtype)
    return buf[:n].view(like.shape)


def _flags(x: Tensor, out: Tensor | None = None) -> Tensor:
    """1.0 where ``x`` is not finite, else 0 (inf * 0 and nan * 0 are nan, and nan != nan)."""
    z = torch.mul(x, 0) if out is None else torch.mul(x, 0, out=out)
    return torch.ne(z, z, out=z)


def _changed(a: Tensor, b: Tensor) -> Tensor:
    """Where ``b`` differs from ``a``; nan to nan is no change (fmax is nan only for two nans).
    Few ops, for small tensors."""
    return torch.ne(a, b) ^ torch.isnan(torch.fmax(a, b))


def _changed_big(a: Tensor, b: Tensor) -> Tensor:
    """``_changed`` as 0.0/1.0 in fast float kernels, for big tensors: ``a != b`` less the
    places where both are nan (the same counts)."""
    both_nan = torch.ne(a, a, out=_scratch(a, 0))
    nan_b = torch.ne(b, b, out=_scratch(b, 1))
    both_nan.mul_(nan_b)
    return torch.ne(a, b, out=nan_b).sub_(both_nan)


def _differ(a: Tensor, b: Tensor, big: bool) -> Tensor:
    """1.0 where ``b`` differs from ``a``, one float pass; nan to nan counts as a change, so
    this is ``_changed`` only where ``b`` holds no nan."""
    return torch.ne(a, b, out=_scratch(a, 0) if big else torch.empty_like(a))


def _matrix(m: Tensor, clipped: Tensor, zero: Tensor, count_bad: bool, own: bool) -> Tensor:
    """[k, 7] sums of each row of ``m``: norm, min, max, sum, negatives, non-finite (``zero``
    unless ``count_bad``), ``clipped``. ``own``: ``m`` is this call's copy, free to overwrite."""
    if m.shape[0] == 1:  # a big tensor: the flat reductions, one pass for min and max
        lo, hi = (t.view(1) for t in torch.aminmax(m.view(-1)))
    else:  # aminmax(dim=1) is ~20x slower than these two on the CPU
        lo, hi = m.amin(1), m.amax(1)
    norm, total = torch.linalg.vector_norm(m, dim=1), m.sum(1)
    # One buffer for the per-entry passes, written last: the copy itself where it may be.
    scratch = m if own and not count_bad else _scratch(m) if m.shape[0] == 1 else torch.empty_like(m)
    bad = _flags(m, out=scratch).sum(1) if count_bad else zero
    neg = torch.lt(m, 0, out=scratch).sum(1)  # nan < 0 is False: left out
    return torch.stack([norm, lo, hi, total, neg, bad, clipped], 1)


def _segments(
    flat: Tensor, lengths: Tensor, tensors: list[Tensor], clipped: Tensor, zero: Tensor, count_bad: bool, own: bool
) -> Tensor:
    """``_matrix``'s columns per segment of ``flat``."""

    def seg(x: Tensor, how: str = "sum") -> Tensor:  # lengths are the layout's own: no checks (a host sync)
        return torch.segment_reduce(x, how, lengths=lengths, unsafe=True)

    norms = torch.stack(torch._foreach_norm([_float(t) for t in tensors]))
    lo, hi, total = seg(flat, "min"), seg(flat, "max"), seg(flat)
    scratch = flat if own and not count_bad else torch.empty_like(flat)
    bad = seg(_flags(flat, out=scratch)) if count_bad else zero
    neg = seg(torch.lt(flat, 0, out=scratch))
    return torch.stack([norms, lo, hi, total, neg, bad, clipped], 1)


def _halves(x: Tensor) -> tuple[Tensor, Tensor]:
    k = x.shape[0] // 2
    return x[:k], x[k:]


def _clipped(lay: Layout, parts: list[Tensor], before: Seen | None, exact: bool) -> list[Tensor]:
    """Per part, the frac_clipped column before division: changed entries of the ``post``
    rows (the second copy, or every row against ``before``), 0 for the others. Not
    ``exact``: by ``_differ``, for post rows whose min and max then prove them free of nan."""
    g, s = len(lay.groups), 1 if lay.singles else 0
    if lay.copies == 1 and before is None:
        return lay.zeros
    out = []
    for j, part in enumerate(parts):
        flat = s and j == g
        if lay.copies == 2:  # bigs alternate pre, post; other parts hold the pre half first
            if j >= g + s and (j - g - s) % 2 == 0:
                out.append(lay.zeros[j])
                continue
            a, b = (parts[j - 1], part) if j >= g + s else _halves(part)
        else:
            a, b = before.parts[j], part
        big = j >= g + s
        c = (_changed_big(a, b) if big else _changed(a, b)) if exact else _differ(a, b, big)
        c = (
            torch.segment_reduce(c.float(), "sum", lengths=lay.lengths[: len(lay.singles)])
            if flat
            else c.sum(1, dtype=torch.float32)
        )
        out.append(c if lay.copies == 1 or j >= g + s else torch.cat([lay.zeros[j][: c.shape[0]], c]))
    return out


def stat_rows(
    tensors: list[Tensor], before: Seen | None = None, keep: str | None = None, paired: bool = False
) -> tuple[Tensor, list[int], Seen | None]:
    """(rows [len(tensors), 7], the tensor index of each row, what a ``post`` partner
    compares with). ``paired``: the first half of ``tensors`` are ``pre`` observations, the
    second half their ``post`` partners, whose rows get ``frac_clipped``. ``before``: a
    ``pre`` call's ``Seen`` of the same tensors before the transforms, for the same.
    ``keep``: None, ``"ref"``, or ``"clone"`` where the tensors change in place before the
    partner looks (small tensors are copied anyway)."""
    with torch.no_grad():
        copies = 2 if paired else 1
        lay = layout(tensors[: len(tensors) // copies], copies)
        parts = _parts(tensors, lay)
        # On the CPU, reading a value back is free: non-finite entries are looked for (their
        # count, nan to nan as no change) only when some row's min or max is not finite (then
        # the sum of all rows is not either), from the tensors again. On CUDA they are looked
        # for every time, without a sync.
        reads = reads_free(tensors[0].device)
        own = keep is None  # else the parts are kept for a post partner: leave them whole
        rows = _columns(tensors, lay, parts, _clipped(lay, parts, before, not reads), not reads, own)
        if reads and not math.isfinite(rows.sum()):
            again = _parts(tensors, lay)
            rows = _columns(tensors, lay, again, _clipped(lay, again, before, True), True, own)
        rows = rows / lay.divisor
        off = len(lay.groups) + (1 if lay.singles else 0)
        if keep == "clone" and lay.bigs:  # a big tensor's part is a view of it
            parts = parts[:off] + [b.clone() for b in parts[off:]]
        return rows, lay.order, None if keep is None else Seen(parts)


def _columns(
    tensors: list[Tensor], lay: Layout, parts: list[Tensor], clipped: list[Tensor], count_bad: bool, own: bool
) -> Tensor:
    """The rows before division, part by part (``own``: the copies may be overwritten)."""
    g, copies = len(lay.groups), lay.copies
    cols = [_matrix(m, c, z, count_bad, own) for m, c, z in zip(parts[:g], clipped, lay.zeros)]
    if lay.singles:
        n = len(tensors) // copies
        singles = [tensors[i + c * n] for c in range(copies) for i in lay.singles]
        cols.append(_segments(parts[g], lay.lengths, singles, clipped[g], lay.zeros[g], count_bad, own))
    off = g + (1 if lay.singles else 0)
    cols.extend(_matrix(b, c, z, count_bad, False) for b, c, z in zip(parts[off:], clipped[off:], lay.zeros[off:]))
    return torch.cat(cols) if len(cols) > 1 else cols[0]
