"""The ``log`` transform: gradient statistics accumulated on the device, read at log points.

At the hook stage the chain does not call an observer per tensor: it hands the gradient
to a ``BackwardEnd``, which computes the rows of every observer of one backward together
(``observe_batch``: a few ops for all tensors), so ``log`` costs few
kernel launches however many tensors it watches. Called directly (the fused stage, a
histogram step, your own code), an observer computes its row at once; both give the
same numbers.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import torch
from torch import Tensor

from gradmod.hooks.mesh.reductions import sharded_rows
from gradmod.hooks.mesh.sharded import is_sharded, plain
from gradmod.hooks.stats.buffer import StatBuffer
from gradmod.hooks.stats.rows import Seen, stat_rows


class GradStats(StatBuffer):
    """The ``log`` transform: statistics of every gradient it sees, accumulated on the
    gradient's device so that observing costs no host sync. ``read()`` syncs once.

    Per buffer (the calls since the last read): mean L2 norm, smallest and largest value,
    mean of the means, mean fraction of negative entries, total count of non-finite
    entries, and ``any_negative`` (the articles' "are there gradients below zero?").

    A ``post`` observer paired with the ``pre`` observer of the same rule (``log`` first
    and last in its chain) also reports ``frac_clipped``: the mean fraction of elements
    that the transforms between them changed (for ``clamp``: the elements clipped to a
    bound). ``pre`` keeps what it saw (``keep``: "ref", or "clone" where gradients change
    in place) until ``post`` compares.

    With ``histogram`` set (the trainer sets it for the step before a read), the call
    also bins the gradient on the device; the last such call's histogram is read with
    the buffer.
    """

    FIELDS = ("norm", "min", "max", "mean", "frac_negative", "nonfinite", "frac_clipped")
    BINS = 30

    def __init__(self, label: str | None = None):
        super().__init__()
        self.label = label
        self._zero: Tensor | None = None  # frac_clipped of an unpaired call
        self.pre: GradStats | None = None  # set on a ``post`` observer: its ``pre`` partner
        self.keep: str | None = None  # on a ``pre`` observer: "ref", or "clone" where grads change in place
        self._seen: Seen | None = None
        self.histogram = False
        self._hist: Tensor | None = None
        self._refs_only = True  # every pending row came by add_from

    def __call__(self, grad: Tensor) -> None:
        self.observe(grad)
        if self.histogram:
            self.observe_histogram(grad)

    def observe(self, grad: Tensor) -> None:
        """This call's row, by the arithmetic of the batched paths (``stat_rows``), so every
        stage reports the same bits."""
        g = grad.detach()
        if is_sharded(g):  # FSDP2: the full tensor's numbers
            self._sharded(g)
            return
        rows, _, seen = stat_rows([g], self.take_before(), self.keep)
        self._seen = seen
        self.add(rows[0])

    def take_before(self):
        """The ``pre`` partner's view of the same gradient (once), or None."""
        if self.pre is None or self.pre._seen is None:
            return None
        before, self.pre._seen = self.pre._seen, None
        return before

    def _sharded(self, g: Tensor) -> None:
        before = self.take_before()
        if self.keep is not None:
            self._seen = g.clone() if self.keep == "clone" else g
        self.add(sharded_rows([g], 0)[0] if before is None else sharded_rows([before, g], 1)[1])

    def observe_histogram(self, g: Tensor) -> None:
        """Bin ``g`` for the next read (FSDP2: gathers the gradient, at histogram steps only)."""
        self._hist = self.bin(plain(g.detach()).float())

    def add(self, row: Tensor) -> None:
        self._refs_only = False
        super().add(row)

    def _reset(self) -> None:
        super()._reset()
        self._hist, self._refs_only = None, True

    def add_from(self, block: Tensor, j: int) -> None:
        """This call's row is row ``j`` of ``block``, the rows of one batch of observers:
        kept as that reference, so a batch costs no tensor per row (``take_all`` reads the
        buffers of one batch together)."""
        self._rows.append((block, j))  # type: ignore[arg-type]
        self.calls += 1
        if len(self._rows) >= self.COMPACT_AT:
            self._compact()

    def _pending(self) -> list[Tensor]:
        return [r if isinstance(r, Tensor) else r[0][r[1]] for r in self._rows]

    def _fold(self) -> Tensor:
        """The pending rows as one row: sums, except min (column 1) and max (column 2)."""
        pending = self._pending()
        return pending[0] if len(pending) == 1 else _fold_rows(torch.stack(pending)[None])[0]

    @classmethod
    def bin(cls, g: Tensor) -> Tensor:
        """[min, max, count, sum, sum of squares, BINS counts] of the finite entries, on
        the device: equal-width bins over [min, max] (scatter_add, not histc or bincount,
        which read the range or the size back to the host on CUDA)."""
        g = g.flatten()
        finite = torch.isfinite(g)
        lo = torch.where(finite, g, math.inf).min()
        hi = torch.where(finite, g, -math.inf).max()
        width = (hi - lo).clamp_min(torch.finfo(g.dtype).tiny)
        idx = ((g - lo) / width * cls.BINS).floor().clamp(0, cls.BINS - 1)
        idx = torch.where(finite, idx, 0).long()
        counts = torch.zeros(cls.BINS, device=g.device).scatter_add_(0, idx, finite.float())
        vals = torch.where(finite, g, 0)
        head = torch.stack([lo, hi, finite.sum().float(), vals.sum(), (vals * vals).sum()])
        return torch.cat([head, counts])

    def take(self) -> tuple[int, Tensor | None]:
        """The pending buffer (calls, device tensor) and a fresh start; no sync. The
        tensor is the FIELDS, then ``bin()``'s values when a histogram was taken."""
        return self.take_folded(self._fold() if self._rows else None)

    def take_folded(self, folded: Tensor | None) -> tuple[int, Tensor | None]:
        """``take()``, with the pending rows already folded into ``folded`` (``take_all``)."""
        hist, calls = self._hist, self.calls
        self._reset()
        return calls, folded if hist is None or folded is None else torch.cat([folded, hist])

    @staticmethod
    def summarize(calls: int, values: list[float], paired: bool = False) -> dict[str, Any]:
        norm, lo, hi, mean, neg, nonfinite, clipped = values[:7]
        out = {
            "norm": norm / calls,
            "min": lo,
            "max": hi,
            "mean": mean / calls,
            "frac_negative": neg / calls,
            "nonfinite": int(nonfinite),
            "any_negative": bool(lo < 0),
            "calls": calls,
        }
        if paired:
            out["frac_clipped"] = clipped / calls
        if len(values) > 7 and values[9] > 0:  # a histogram of at least one finite entry
            h_lo, h_hi, num, total, squares = values[7:12]
            counts = values[12:]
            width = h_hi - h_lo if h_hi > h_lo else max(abs(h_lo), 1.0) * 1e-6
            out["histogram"] = {
                "min": h_lo,
                "max": h_hi,
                "num": int(num),
                "sum": total,
                "sum_squares": squares,
                "bucket_limits": [h_lo + width * (k + 1) / len(counts) for k in range(len(counts))],
                "bucket_counts": counts,
            }
        return out


def take_all(buffers: list[StatBuffer]) -> list[tuple[int, Tensor | None]]:
    """``[w.take() for w in buffers]``, the same values, with the ``log`` buffers of equal
    length folded together: a few ops for all of them, instead of one per pending row of
    each (a read of 400 tensors' 50 rows was 20,000 ops). Windows whose rows all lie in the
    same batches (``add_from``) are gathered from those batches' blocks directly. Folded by
    ``_fold_rows``, as ``_fold`` does."""
    out: list[tuple[int, Tensor | None] | None] = [None] * len(buffers)
    batched: dict[tuple, list[int]] = {}
    groups: dict[tuple, list[int]] = {}
    for i, w in enumerate(buffers):
        if type(w) is not GradStats or len(w._rows) < 2:  # another kind of record, or nothing to fold
            out[i] = w.take()
        elif w._refs_only and type(w._rows[0]) is tuple:  # not compacted nor loaded either
            batched.setdefault(tuple(map(id, map(_first, w._rows))), []).append(i)
        else:
            first = w._pending()[0]
            groups.setdefault((len(w._rows), first.shape, first.device, first.dtype), []).append(i)
    for ix in batched.values():
        blocks = list(map(_first, buffers[ix[0]]._rows))  # one per call, of any number of rows
        starts = [0]
        for b in blocks[:-1]:
            starts.append(starts[-1] + b.shape[0])
        device = blocks[0].device
        at = torch.tensor([list(map(_second, buffers[i]._rows)) for i in ix], device=device)
        _fold_into(out, buffers, ix, torch.cat(blocks)[at + torch.tensor(starts, device=device)])
    for ix in groups.values():
        rows = torch.stack([r for i in ix for r in buffers[i]._pending()])
        _fold_into(out, buffers, ix, rows.view(len(ix), len(buffers[ix[0]]._rows), -1))
    return out  # type: ignore[return-value]


_first, _second = operator.itemgetter(0), operator.itemgetter(1)


def _fold_rows(rows: Tensor) -> Tensor:
    """[buffers, calls (two or more), values] to [buffers, values]: sums, except min (column
    1) and max (column 2). Left to right, so folding in pieces (a resume) gives the same bits."""
    acc = rows[:, 0] + rows[:, 1]
    for c in range(2, rows.shape[1]):
        acc = acc + rows[:, c]
    acc[:, 1], acc[:, 2] = rows[:, :, 1].amin(1), rows[:, :, 2].amax(1)
    return acc


def _fold_into(out: list, buffers: list[StatBuffer], ix: list[int], rows: Tensor) -> None:
    """``rows`` [buffers, calls, values]: each buffer's rows folded as ``_fold`` does."""
    acc = _fold_rows(rows)
    for j, i in enumerate(ix):
        out[i] = buffers[i].take_folded(acc[j])


def observe_batch(
    observers: list[GradStats], tensors: list[Tensor], in_place: bool = False, histograms: bool = False
) -> None:
    """The rows of one rule's observers at one chain position (one per tensor), computed
    together. ``post`` observers compare with what their ``pre`` partners kept of the same
    tensors, in the same order (both positions see the same tensors). ``in_place``: the
    transforms that follow change ``tensors`` in place, so a ``pre`` keeps a copy.
    ``histograms``: also bin each tensor whose observer is to (not yet binned elsewhere)."""
    if histograms:
        for obs, t in zip(observers, tensors):
            if obs.histogram:
                obs.observe_histogram(t)
    if any(is_sharded(t) for t in tensors):
        _observe_sharded(observers, tensors)
        return
    before = observers[0].take_before()
    for obs in observers[1:]:
        if obs.pre is not None:
            obs.pre._seen = None
    keep = observers[0].keep
    if in_place and keep == "ref":
        keep = "clone"
    rows, order, seen = stat_rows(tensors, before, keep)
    _add(observers, rows, order)
    if keep is not None:
        for obs in observers:
            obs._seen = seen


def _observe_sharded(observers: list[GradStats], tensors: list[Tensor]) -> None:
    """``observe_batch`` for DTensors: the rows of all tensors from one ``sharded_rows``
    call, so a rule's statistics cost a few collectives per mesh, not a few per tensor."""
    befores = [obs.take_before() for obs in observers]
    n = len(tensors)
    if all(b is not None for b in befores):
        rows = sharded_rows(befores + tensors, n)[n:]  # type: ignore[operator]
    elif all(b is None for b in befores):
        rows = sharded_rows(tensors, 0)
    else:  # some pre partners saw nothing: one by one
        rows = [sharded_rows([t], 0)[0] if b is None else sharded_rows([b, t], 1)[1] for t, b in zip(tensors, befores)]
    for obs, t, row in zip(observers, tensors, rows):
        if obs.keep is not None:
            obs._seen = t.detach().clone() if obs.keep == "clone" else t.detach()
        obs.add(row)


def observe_pairs(pres: list[GradStats], before: list[Tensor], posts: list[GradStats], after: list[Tensor]) -> None:
    """``observe_batch`` of a ``pre`` position and its ``post`` partners (``posts[i].pre is
    pres[i]``) in one go: the same bits as the two apart, fewer ops."""
    if any(is_sharded(t) for t in before + after):
        observe_batch(pres, before)
        observe_batch(posts, after)
        return
    rows, order, _ = stat_rows(before + after, paired=True)
    _add(pres + posts, rows, order)


def _add(observers: list[GradStats], rows: Tensor, order: list[int]) -> None:
    for j, i in enumerate(order):
        observers[i].add_from(rows, j)


def log(label: str | None = None) -> GradStats:
    """Leave the gradient unchanged; accumulate its statistics on the device."""
    return GradStats(label)
