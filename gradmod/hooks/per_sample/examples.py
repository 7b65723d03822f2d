"""Each example's gradient norm over its rule's parameters, and the weighted sums
``sum_i w_i g_i`` the stage forms from one backward's followed calls (to clip, to check, to log):
in closed form where a layer's form answers without per-example tensors (its ``norms2`` and
``weighted``), else from the per-example tensors it forms, summed per parameter."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from gradmod.hooks.per_sample import tied
from gradmod.hooks.per_sample.accounts import Probed
from gradmod.hooks.per_sample.assign import Call
from gradmod.hooks.per_sample.forms.base import PerExample, rows_norm2
from gradmod.hooks.per_sample.trainable import Trainable


@dataclass
class Seen:
    """One backward's examples: ``batch`` of them, each one's gradient ``scale`` times what its output
    gradients give; the calls answered without per-example tensors (``ghost``: with their output
    gradients), the others' per-example gradients summed per parameter (``full``); each rule's norms."""

    batch: int
    scale: float
    ghost: list
    full: dict[nn.Parameter, Tensor]
    norms: dict[str, Tensor]

    def ones(self) -> dict[str, Tensor]:
        return {r: torch.ones_like(v) for r, v in self.norms.items()}


class PerExampleSums:
    """The norms and weighted sums of the rules' parameters; ``rule_of``: id(param) -> its rule,
    ``trainable``: what trains now, ``probed``: the probe check, fed in the same passes."""

    def __init__(self, rule_of: dict[int, object], trainable: Trainable, probed: Probed):
        self._rule_of: dict = rule_of
        self._trainable, self._probed = trainable, probed

    def seen(
        self, calls: list[Call], rules: list, loss_reduction: str, verify: bool, detached: set[int]
    ) -> Seen | None:
        """Each rule's per-example norms over its parameters (None: an empty batch, nothing to clip;
        the step may still add noise)."""
        bsz = calls[0].batch()
        if bsz == 0:
            return None
        scale = float(bsz) if loss_reduction == "mean" else 1.0  # per-example = scale * what b gives
        dtype = torch.promote_types(calls[0].shapes[0][1], torch.float32)  # norms in float32 or better
        norms2 = {r.name: torch.zeros(bsz, dtype=dtype, device=calls[0].shapes[0][2]) for r in rules}
        ghost, full = self._norms(calls, norms2, verify, detached)
        return Seen(bsz, scale, ghost, full, {r: v.sqrt() * scale for r, v in norms2.items()})

    def _norms(
        self, calls: list[Call], norms2: dict[str, Tensor], verify: bool, detached: set[int]
    ) -> tuple[list, dict[nn.Parameter, Tensor]]:
        """Add each call's squared per-example norms to its rules' ``norms2``. Returns the calls answered
        without per-example tensors (with their output gradients), and the others' summed per parameter."""
        seen = Counter(id(c.layer) for c in calls)
        ghost, summed = [], PerExample()
        pairs = tied.shared(calls) & self._trainable.live  # shared weights' cross terms
        norms2_dtype = next(iter(norms2.values())).dtype
        for c in calls:
            live = self._live(c)  # frozen ones take no part
            b, form, names = c.output_grads(), c.layer.form, set(live)
            full_ = c.layer.materialise or seen[id(c.layer)] > 1 or form.materialises(c.layer.module, c.inputs, b)
            full_ = c.formed is not None or full_ and not any(id(p) in pairs for p in live.values())
            c.layer.materialised = full_
            if full_:
                summed.add(form, c.layer.module, c.inputs, b, live, c.formed)
            else:
                by_name = form.norms2(c.layer.module, c.inputs, b, names)
                for n, v in by_name.items():
                    norms2[self._rule_of[id(c.layer.names[n])].name] += v.to(norms2_dtype)
                ghost.append((c, b))
                if not (verify or {id(p) for p in live.values()} <= detached):  # (else refused)
                    self._probed.ghost(c.layer, c.inputs, b, by_name)
        for i in pairs:
            norms2[self._rule_of[i].name] += tied.cross_norms2(i, ghost, norms2_dtype)
        for p, g in summed.sums.items():
            rows2 = rows_norm2(g, norms2_dtype)
            norms2[self._rule_of[id(p)].name] += rows2
            if not verify:
                self._probed.full(p, rows2, None if self._rule_of[id(p)].clip else g)  # (else summed when clipped)
        return ghost, summed.sums

    def _live(self, c: Call) -> dict[str, nn.Parameter]:
        """The call's parameters that train now, of those it gives a part of (``Call.only``)."""
        live = self._trainable.names(c.layer)
        return live if c.only is None else {n: p for n, p in live.items() if n in c.only}

    def weighted(self, seen: Seen, weights: dict[str, Tensor], probe: bool = False) -> dict[nn.Parameter, Tensor]:
        """``sum_i w_i g_i`` for each parameter of the rules in ``weights`` (rule -> [B]); ``probe``:
        per-example tensors also summed plainly in the same pass, for the probe check."""
        out: dict[nn.Parameter, Tensor] = {}
        for c, b in seen.ghost:
            by_rule: dict[str, set[str]] = {}
            for n, p in self._live(c).items():
                by_rule.setdefault(self._rule_of[id(p)].name, set()).add(n)
            for rule, names in by_rule.items():
                if rule in weights:
                    for n, g in c.layer.form.weighted(c.layer.module, c.inputs, b, weights[rule], names).items():
                        p = c.layer.names[n]  # a shared weight's calls add up
                        out[p] = g.to(p.dtype) if p not in out else out[p] + g.to(p.dtype)
        for p, g in seen.full.items():
            rule = self._rule_of[id(p)].name
            if rule in weights:
                w = weights[rule].to(g.dtype)
                both = torch.tensordot(torch.stack([w, torch.ones_like(w)]) if probe else w, g, 1)
                out[p] = (both[0] if probe else both).to(p.dtype)
                self._probed.summed(p, both[1]) if probe else None
        return out
