"""Every gradient of a clipped parameter accounted for: autograd's whole gradient of a
parameter against the sum of the per-example gradients the stage followed.

After each backward: every parameter autograd gave a gradient came through a followed call
(``check_covered``). At the first backward: the followed calls' gradients add up to
autograd's, whole (``check_sums``). At every later one: the same along one random direction
per parameter (``Probed``, see ``probes``), so a use that starts after the first backward (a
weight used functionally, or in the loss, from some step on) is refused too; a hung weight
(``detached_weights.hang``) whose gradient is the very tensor its one call gave needs no probe.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from gradmod.hooks.per_sample.probes import Probe, ghost_probe, probe_dot, probe_for, probe_norm

OUTSIDE = (
    "got part of its gradient outside the module calls the stage follows (used outside the model's "
    "forward, e.g. in the loss, or functionally"
)


def _tolerance(eps: float) -> float:
    """Rounding allowance in units of the dtype's eps: bf16's few digits need less headroom."""
    return (10 if eps > 1e-4 else 1e3) * eps


def check_covered(names: dict[int, str], covered: set[int], got: dict[int, Any], set_up: bool) -> None:
    """Every parameter autograd gave a gradient came through a call the stage follows."""
    missing = [i for i in got if i not in covered]
    if not missing:
        return
    name = names[missing[0]]
    if not set_up:
        raise ValueError(
            f"per_sample: {name!r} got a gradient before the attached model's first training "
            "forward set the stage up; call the model you attached (not one of its parts)"
        )
    raise ValueError(
        f"per_sample: {name!r} got a gradient from outside every module call the stage follows "
        "(used outside the model's forward, e.g. in the loss, or in a way its first forward did "
        "not); its per-example gradient is unknown, so it is neither clipped nor kept"
    )


def refuse_arrivals(got: dict[int, Any], detached: set[int], names: dict[int, str]) -> None:
    """A detached weight got a gradient from autograd: a use outside the followed calls."""
    arrived = next((i for i in got if i in detached), None)
    if arrived is not None:
        raise ValueError(
            f"per_sample: {names[arrived]!r} {OUTSIDE}, here after the first backward); that part "
            "has no per-example split, so the parameter cannot be clipped"
        )


def check_sums(summed: dict, got: dict[int, Tensor | None], names: dict[int, str], skip: set[int], grad_eps: float):
    """The followed calls' gradients (``summed``: parameter -> sum over examples) add up to autograd's."""
    scale = max((float(g.norm()) for g in got.values() if g is not None), default=0.0)
    for p, g in summed.items():
        whole = got.get(id(p))
        if whole is None or id(p) in skip:
            continue
        # rounding: relative to this gradient, or to the largest where this one is ~0 exactly
        tol = _tolerance(max(torch.finfo(g.dtype).eps, grad_eps)) * max(float(whole.norm()), 1e-3 * scale) + 1e-30
        if float((g - whole).norm()) > tol:
            raise ValueError(
                f"per_sample: {names[id(p)]!r} {OUTSIDE}); that part has no per-example split, so the "
                "parameter cannot be clipped"
            )


class Probed:
    """Per backward after the first: each parameter's gradient along its fixed direction R,
    from autograd (``arrived``) and from the followed calls (``ghost``, ``full``)."""

    def __init__(self) -> None:
        self.probes: dict[int, Probe] = {}
        self.norms: dict[int, Tensor] = {}
        self.got: dict[int, Tensor] = {}  # id -> <g, R>
        self.ours: dict[int, Tensor] = {}  # id -> sum_i <g_i, R>
        self.spread: dict[int, Tensor] = {}  # id -> sum_i |g_i| (the rounding's scale)
        self.unchecked: set[int] = set()
        self.hung: set[int] = set()  # ids whose followed calls give their gradient (``detached_weights.hang``)
        self.given: dict[int, list[Tensor]] = {}  # id -> the gradients those calls gave in this backward
        self.pending: tuple[list[str], Tensor, Any] | None = None  # CUDA: flags read one backward later

    def set_up(self, params: list[Tensor]) -> None:
        self.probes = {id(p): probe_for(p, seed) for seed, p in enumerate(params)}
        self.norms = {i: probe_norm(probe) for i, probe in self.probes.items()}  # |R|, read at every check

    def gave(self, p: Tensor, g: Tensor) -> None:
        self.given.setdefault(id(p), []).append(g)

    def forget_given(self) -> None:
        """A backward checked whole (no probe): what its hung calls gave is not the next one's."""
        self.hung, self.given = set(), {}

    def arrived(self, p: Tensor, g: Tensor) -> None:
        """Autograd's whole gradient of ``p``. A hung parameter's is the very tensor its one
        call gave where nothing else reached it: no probe; else both sides along R."""
        if id(p) in self.hung:
            given = self.given.pop(id(p), [])
            if len(given) == 1 and g is given[0]:
                return
            self.ours[id(p)] = probe_dot(sum(given), self.probes[id(p)]) if given else g.new_zeros(())
        self.got[id(p)] = probe_dot(g, self.probes[id(p)])

    def _add(self, p: Tensor, ours: Tensor | None, spread: Tensor | None) -> None:
        """Add to ``p``'s ``sum_i <g_i, R>`` and ``sum_i |g_i|`` what a call gave (None: nothing)."""
        if ours is not None:
            self.ours[id(p)] = ours if id(p) not in self.ours else self.ours[id(p)] + ours
        if spread is not None:
            self.spread[id(p)] = spread if id(p) not in self.spread else self.spread[id(p)] + spread

    def ghost(self, layer, inputs, b, norms2: dict[str, Tensor]) -> None:
        """A call answered without per-example tensors; ``norms2``: its per-example squared norms
        (a hung call gave its gradients itself: their spread alone)."""
        if all(id(layer.names[n]) in self.hung for n in norms2):
            for n in norms2:
                self._add(layer.names[n], None, norms2[n].sqrt().sum())
            return
        probes = {n: self.probes[id(layer.names[n])] for n in norms2}  # the layer's parameters that train
        found = ghost_probe(layer.form, layer.module, inputs, b, probes, set(norms2))
        for n in norms2:
            p = layer.names[n]
            if found is None or n not in found:
                self.unchecked.add(id(p))
            else:
                self._add(p, found[n], norms2[n].sqrt().sum())

    def full(self, p: Tensor, rows2: Tensor, g: Tensor | None = None) -> None:
        """The squared norms ``rows2`` of per-example gradients of ``p`` the stage formed; ``g``:
        those gradients, where no clipped sum reads them (a rule that keeps or logs norms only)."""
        self._add(p, None, rows2.sqrt().sum())
        if g is not None and id(p) not in self.hung:  # (a hung call gave its sum already)
            self.summed(p, g)

    def summed(self, p: Tensor, g: Tensor) -> None:
        """Their sum over the examples (one pass, beside the clipped sum: not a second read)."""
        self._add(p, probe_dot(g, self.probes[id(p)]), None)

    def check(self, names: dict[int, str], skip: set[int], grad_eps: float) -> None:
        got, ours, spread, unchecked = self.got, self.ours, self.spread, self.unchecked | skip
        self.got, self.ours, self.spread, self.unchecked, self.hung, self.given = {}, {}, {}, set(), set(), {}
        ids = [i for i in got if i in ours and i not in unchecked]
        if not ids:
            return
        mine = torch.stack([ours[i].to(got[i].dtype) for i in ids])
        theirs = torch.stack([got[i] for i in ids])
        # rounding: relative to the examples' gradients (sum_i |g_i| >= |g| where nothing escaped),
        # or to the largest where this parameter's are ~0 exactly
        spreads = torch.stack([spread[i].to(theirs.dtype) if i in spread else theirs.new_zeros(()) for i in ids])
        scale = torch.maximum(spreads, 1e-3 * spreads.max()) * torch.stack([self.norms[i] for i in ids])
        eps = max(torch.finfo(theirs.dtype).eps, grad_eps)
        flags = (mine - theirs).abs() > _tolerance(eps) * scale + 1e-30
        self.settle()
        shown = [names[i] for i in ids]
        if flags.is_cuda:  # read at the next backward or step, when the copy is long done: no stall
            event = torch.cuda.Event()
            self.pending = (shown, flags.to("cpu", non_blocking=True), event)
            event.record()
        else:
            _refuse(shown, flags)

    def settle(self) -> None:
        """Refuse what an earlier backward's check found (on CUDA the flags arrive late)."""
        if self.pending is not None:
            shown, flags, event = self.pending
            self.pending = None
            event.synchronize()
            _refuse(shown, flags)


def _refuse(shown: list[str], flags: Tensor) -> None:
    bad = flags.nonzero()
    if len(bad):
        raise ValueError(
            f"per_sample: {shown[int(bad[0])]!r} {OUTSIDE}, here after the first backward); that part "
            "has no per-example split, so the parameter cannot be clipped"
        )
