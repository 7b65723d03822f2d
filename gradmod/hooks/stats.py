"""The ``log`` transform: gradient statistics accumulated on the device, read at log points.

At the hook stage the chain does not call an observer per tensor: it hands the gradient
to a ``LogBuffer``, which computes the rows of every observer of one backward together
(``batch_rows``: a few ops for all tensors, plus two per tensor), so ``log`` costs few
kernel launches however many tensors it watches. Called directly (the fused stage, a
histogram step, your own code), an observer computes its row at once; both give the
same numbers.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch
from torch import Tensor

from gradmod.hooks.registry import register
from gradmod.hooks.sharded import is_sharded, plain, sharded_rows
from gradmod.hooks.transforms import Transform


class GradStats:
    """The ``log`` transform: statistics of every gradient it sees, accumulated on the
    gradient's device so that observing costs no host sync. ``read()`` syncs once.

    Per window (the calls since the last read): mean L2 norm, smallest and largest value,
    mean of the means, mean fraction of negative entries, total count of non-finite
    entries, and ``any_negative`` (the articles' "are there gradients below zero?").

    A ``post`` observer paired with the ``pre`` observer of the same rule (``log`` first
    and last in its chain) also reports ``frac_clipped``: the mean fraction of elements
    that the transforms between them changed (for ``clamp``: the elements clipped to a
    bound). ``pre`` keeps a reference to the gradient it saw until ``post`` compares.

    With ``histogram`` set (the trainer sets it for the step before a read), the call
    also bins the gradient on the device; the last such call's histogram is read with
    the window.
    """

    FIELDS = ("norm", "min", "max", "mean", "frac_negative", "nonfinite", "frac_clipped")
    BINS = 30
    COMPACT_AT = 256  # pending rows folded into one on the device, so memory stays bounded

    def __init__(self, label: str | None = None):
        self.label = label
        self.calls = 0
        self._rows: list[Tensor] = []  # per call (or folded window): FIELDS, as sums except min and max
        self._zero: Tensor | None = None  # frac_clipped of an unpaired call
        self.pre: GradStats | None = None  # set on a ``post`` observer: its ``pre`` partner
        self.keep: str | None = None  # on a ``pre`` observer: "ref", or "clone" where grads change in place
        self._seen: Tensor | None = None
        self.histogram = False
        self._hist: Tensor | None = None

    def __call__(self, grad: Tensor) -> None:
        # The same arithmetic as the batched hook-stage path (batch_rows), so both stages
        # report the same bits.
        g = grad.detach()
        before = None
        if self.pre is not None and self.pre._seen is not None:
            before, self.pre._seen = self.pre._seen, None
        if self.keep is not None:
            self._seen = g.clone() if self.keep == "clone" else g
        rows = sharded_rows if is_sharded(g) else batch_rows  # FSDP2: the full tensor's numbers
        row = rows([g], 0)[0] if before is None else rows([before, g], 1)[1]
        if self.histogram:
            self._hist = self.bin(plain(g).float())  # FSDP2: gathers the gradient, at histogram steps only
        self.add_row(row)
        return None

    @property
    def _sum(self) -> Tensor | None:
        """The pending window as one row (None when empty)."""
        return self._fold() if self._rows else None

    def state_dict(self) -> dict[str, Any]:
        """The window in progress (calls and its row), for checkpoints."""
        return {"calls": self.calls, "window": self._sum}

    def load_state_dict(self, state: Mapping[str, Any], device: torch.device | None = None) -> None:
        """Continue the saved window; ``device``: where this run's gradients are."""
        window = state["window"]
        self.calls = state["calls"]
        self._rows = [] if window is None else [window if device is None else window.to(device)]

    def _fold(self) -> Tensor:
        """The pending rows as one row: sums, except min (column 1) and max (column 2)."""
        if len(self._rows) == 1:
            return self._rows[0]
        out = self._rows[0]
        for row in self._rows[1:]:  # left to right, so folding in pieces (a resume) gives the same bits
            out = out + row
        rows = torch.stack(self._rows)
        out[1:3] = torch.stack([rows[:, 1].min(), rows[:, 2].max()])
        return out

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

    def add_row(self, row: Tensor) -> None:
        """A row computed elsewhere (``batch_rows``) for one call."""
        self._rows.append(row)
        self.calls += 1
        if len(self._rows) >= self.COMPACT_AT:
            self._rows = [self._fold()]

    def take(self) -> tuple[int, Tensor | None]:
        """The pending window (calls, device tensor) and a fresh start; no sync. The
        tensor is the FIELDS, then ``bin()``'s values when a histogram was taken."""
        acc = self._fold() if self._rows else None
        out = acc if self._hist is None or acc is None else torch.cat([acc, self._hist])
        calls = self.calls
        self.calls, self._rows, self._hist = 0, [], None
        return calls, out

    @staticmethod
    def summarize(calls: int, values: list[float], paired: bool = False) -> dict[str, Any]:
        norm, lo, hi, mean, neg, nonfinite, clipped = values[:7]
        out = {
            "norm": norm / calls, "min": lo, "max": hi, "mean": mean / calls,
            "frac_negative": neg / calls, "nonfinite": int(nonfinite),
            "any_negative": bool(lo < 0), "calls": calls,
        }
        if paired:
            out["frac_clipped"] = clipped / calls
        if len(values) > 7 and values[9] > 0:  # a histogram of at least one finite entry
            h_lo, h_hi, num, total, squares = values[7:12]
            counts = values[12:]
            width = h_hi - h_lo if h_hi > h_lo else max(abs(h_lo), 1.0) * 1e-6
            out["histogram"] = {
                "min": h_lo, "max": h_hi, "num": int(num), "sum": total, "sum_squares": squares,
                "bucket_limits": [h_lo + width * (k + 1) / len(counts) for k in range(len(counts))],
                "bucket_counts": counts,
            }
        return out

    def read(self) -> dict[str, Any] | None:
        calls, acc = self.take()
        return None if acc is None else self.summarize(calls, acc.tolist(), self.pre is not None)


_SEGMENTS: dict[tuple, tuple[Tensor, Tensor]] = {}  # (sizes, device) -> (lengths, sizes as float)


def _segments(sizes: tuple[int, ...], device: torch.device) -> tuple[Tensor, Tensor]:
    """The segment lengths and element counts of one layout, built once per layout."""
    key = (sizes, str(device))
    if key not in _SEGMENTS:
        if len(_SEGMENTS) > 64:  # layouts change only with the batch size of module outputs
            _SEGMENTS.clear()
        n = torch.tensor(sizes, device=device)
        _SEGMENTS[key] = (n, n.float())
    return _SEGMENTS[key]


def batch_rows(tensors: list[Tensor], paired: int) -> list[Tensor]:
    """``GradStats`` rows (FIELDS) of many gradients in one go: a handful of ops for all
    of them plus one per tensor (a flattening view); NaN propagates into min and max
    as in the per-call path. The first ``paired`` tensors are ``pre`` observations and
    the next ``paired`` their ``post`` partners (same shapes), whose rows get
    ``frac_clipped``; every other row gets 0 there."""
    gf = [t.detach().float() for t in tensors]
    sizes = tuple(t.numel() for t in gf)
    lengths, count = _segments(sizes, gf[0].device)
    flat = torch.cat([t.reshape(-1) for t in gf])
    nonfinite = (flat * 0).isnan()  # inf * 0 and nan * 0 are nan: one flag for both
    sums = torch.segment_reduce(torch.stack([flat, flat < 0, nonfinite], 1), "sum", lengths=lengths, axis=0)
    # max of (x, -x) per tensor: the largest and minus the smallest entry; NaN propagates.
    extremes = torch.segment_reduce(torch.stack([flat, -flat], 1), "max", lengths=lengths, axis=0)
    clipped = torch.zeros(len(gf), device=flat.device)
    if paired:
        split = sum(sizes[:paired])
        before, after = flat[:split], flat[split:2 * split]
        changed = (after != before) & ~((after != after) & (before != before))  # nan -> nan is no change
        per_pair = torch.segment_reduce(changed.float(), "sum", lengths=lengths[paired:2 * paired])
        clipped[paired:2 * paired] = per_pair / count[paired:2 * paired]
    means = sums / count[:, None]
    lo, hi = (-extremes).unbind(1)[1], extremes.unbind(1)[0]
    mean, negative, _ = means.unbind(1)
    rows = torch.stack([torch.stack(torch._foreach_norm(gf)), lo, hi, mean, negative, sums.unbind(1)[2], clipped], 1)
    return list(rows.unbind(0))


def log(label: str | None = None) -> Transform:
    """Leave the gradient unchanged; accumulate its statistics on the device."""
    return GradStats(label)


register("log", log, observer=True)
