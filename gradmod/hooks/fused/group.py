"""Group transforms: act on all the gradients one rule selects, together.

``global_norm_clip`` (``torch.nn.utils.clip_grad_norm_`` over the rule's parameters),
``agc`` (adaptive, unit-wise clipping, Brock et al. 2021) and ``freeze`` (``.grad =
None``); ``autoclip`` and ``zclip``, whose thresholds come from the history of norms, are
in ``gradmod.hooks.fused.norm_history``. They need every gradient of
the rule after backward, so they run at the fused stage only, in place on the accumulated
``.grad`` tensors, chained in config order with the rule's other transforms.

Each keeps a ``NormRecord`` on the device: per call the total L2 norm before the
transform and the clip coefficient it applied, read at log points by
``HookSet.read_stats`` under the key ``<rule>/<transform>``. No host sync per step,
except ``zclip(on_spike="skip")``, whose answer the loop must read.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from gradmod.hooks.mesh import reductions as mesh
from gradmod.hooks.mesh.sharded import is_sharded, plain
from gradmod.hooks.stats.buffer import StatBuffer
from gradmod.hooks.stats.rows import BIG
from gradmod.hooks.validators import number, positive

EPS = 1e-6  # clip_grad_norm_'s guard against a zero norm, kept for bit-equality


def total_norm(grads: list[Tensor], norm_type: float = 2.0) -> Tensor:
    """The norm of all ``grads`` as one vector: one ``_foreach_norm``, then the norm of the
    norms. DTensors (any mesh, any layout, several meshes): ``reductions.mesh_norm``, a plain tensor."""
    if any(is_sharded(g) for g in grads):
        return mesh.mesh_norm(grads, norm_type)
    norms = torch._foreach_norm(grads, norm_type)
    device = grads[0].device
    return torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]), norm_type)


class NormRecord(StatBuffer):
    """Per call: total norm before the transform and clip coefficient, kept on the device;
    a buffer of 2-column rows folded into a 5-value summary."""

    def __init__(self):
        super().__init__()
        self._summary: Tensor | None = None  # [norm sum, norm max, coef sum, coef min, clipped calls]

    def add(self, norm: Tensor, coef: Tensor) -> None:  # type: ignore[override]
        super().add(torch.stack([plain(norm).float(), plain(coef).float()]))  # FSDP2: replicated values

    def _fold(self) -> Tensor | None:  # type: ignore[override]
        parts = [] if self._summary is None else [self._summary]
        if self._rows:
            r = torch.stack(self._rows)
            n, c = r[:, 0], r[:, 1]
            parts.append(torch.stack([n.sum(), n.max(), c.sum(), c.min(), (c < 1).sum().float()]))
        if len(parts) < 2:
            return parts[0] if parts else None
        a, b = parts
        return torch.stack(
            [a[0] + b[0], torch.maximum(a[1], b[1]), a[2] + b[2], torch.minimum(a[3], b[3]), a[4] + b[4]]
        )

    def _compact(self) -> None:
        self._summary, self._rows = self._fold(), []

    def _reset(self) -> None:
        super()._reset()
        self._summary = None

    def take(self) -> tuple[int, Tensor | None]:
        out, calls = self._fold(), self.calls  # a summary alone is a buffer too
        self._reset()
        return calls, out

    @staticmethod
    def summarize(calls: int, values: list[float], paired: bool = False) -> dict[str, Any]:
        norm_sum, norm_max, coef_sum, coef_min, clipped = values[:5]
        return {
            "norm": norm_sum / calls,
            "norm_max": norm_max,
            "clip_coef": coef_sum / calls,
            "clip_coef_min": coef_min,
            "frac_clipped": clipped / calls,
            "calls": calls,
        }

    def state_dict(self) -> dict[str, Any]:
        # The rows as they are, not folded: a resumed run then sums them in the same order
        # as an uninterrupted one, and its statistics agree to the last bit.
        rows = torch.stack(self._rows) if self._rows else None
        return {"calls": self.calls, "window": self._summary, "rows": rows}

    def load_state_dict(self, state: Mapping[str, Any], device: torch.device | None = None) -> None:
        move = (lambda t: t) if device is None else (lambda t: t.to(device))
        buffer, rows = state["window"], state.get("rows")
        self.calls = state["calls"]
        self._summary = None if buffer is None else move(buffer)
        self._rows = [] if rows is None else list(move(rows).unbind(0))


class GroupTransform:
    """Base of the group transforms: ``apply_(params, grads)`` changes ``grads`` in place
    and returns a device bool "skip this step", or None."""

    name = "group"
    skip = False  # True: apply_ may answer "skip this step", which the loop must read
    # True: the rule's parameters take no part in the backward while it acts (requires_grad
    # off, ``gradmod.hooks.fused.trainability``): under DDP the wrapper must find them unused
    switches_trainability = False

    def __init__(self):
        self.record = NormRecord()

    def bind(self, rule: str, named: Mapping[str, Tensor]) -> None:
        """The rule's tensors by name, at attach, before anything is hooked: refuse in one
        line those this transform cannot act on (``orthogonalize``: vectors)."""

    def apply_(self, params: list[Tensor], grads: list[Tensor]) -> Tensor | None:
        raise NotImplementedError

    def __call__(self, grad: Tensor) -> Tensor | None:
        raise TypeError(
            f"{self.name!r} is a group transform: it runs at the fused stage over all "
            "of a rule's gradients (HookSet.after_backward), not on one tensor"
        )

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any], device: torch.device | None = None) -> None:
        pass


class GlobalNormClip(GroupTransform):
    """Scale all gradients by ``min(1, max_norm / (total_norm + 1e-6))``: ``clip_grad_norm_``."""

    name = "global_norm_clip"

    def __init__(self, max_norm: float, norm_type: float = 2.0):
        super().__init__()
        self.max_norm = positive(self.name, "max_norm", max_norm, allow_zero=False)
        self.norm_type = _norm_type(self.name, norm_type)

    def apply_(self, params: list[Tensor], grads: list[Tensor]) -> None:
        norm = total_norm(grads, self.norm_type)
        coef = (self.max_norm / (norm + EPS)).clamp(max=1.0)
        torch._foreach_mul_([mesh.local(g) for g in grads], coef)  # a plain factor, each rank's pieces
        self.record.add(norm, coef)


def _norm_type(transform: str, value: Any) -> float:
    if isinstance(value, str) and value.lower() in ("inf", "infinity"):
        return math.inf
    v = number(transform, "norm_type", value, finite=False)
    if not (v >= 1):
        raise ValueError(f"transform {transform!r}: norm_type={value!r} must be >= 1 or 'inf'")
    return v


def unit_norms(x: Tensor, norm_type: float = 2.0, stacked: bool = False) -> Tensor:
    """Norm per output unit (over every dim but the first, kept for broadcasting);
    a vector or scalar as a whole. ``stacked``: ``x`` is [k, *shape], k tensors' norms."""
    lead = 1 if stacked else 0
    if x.dim() <= 1 + lead:
        return torch.linalg.vector_norm(x, norm_type, dim=tuple(range(lead, x.dim())), keepdim=stacked)
    return torch.linalg.vector_norm(x, norm_type, dim=tuple(range(1 + lead, x.dim())), keepdim=True)


class AGC(GroupTransform):
    """Adaptive gradient clipping: each unit's gradient norm is capped at ``clip_factor``
    times its weights' norm (at least ``eps``), so a step changes a unit's weights by a
    bounded fraction. Leave the classifier out of the rule (Brock et al. 2021).
    ``norm_type`` is the unit norm's order, as in timm's ``adaptive_clip_grad``."""

    name = "agc"

    def __init__(self, clip_factor: float = 0.01, eps: float = 1e-3, norm_type: float = 2.0):
        super().__init__()
        self.clip_factor = positive(self.name, "clip_factor", clip_factor, allow_zero=False)
        self.eps = positive(self.name, "eps", eps, allow_zero=False)
        self.norm_type = _norm_type(self.name, norm_type)

    def apply_(self, params: list[Tensor], grads: list[Tensor]) -> None:
        if any(is_sharded(g) for g in grads):
            self._apply_sharded(params, grads)
            return
        with torch.no_grad():  # the weights' norms record no graph
            # L2 unit norms give the total norms with no pass over the gradients; else total_norm.
            from_units = self.norm_type == 2
            before = None if from_units else total_norm(grads)
            norms, clipped = [], []  # each group's unit norms, before and after
            for ps, gs in _by_shape(params, grads):
                stacked = len(gs) > 1  # one set of unit-norm ops for all tensors of this shape
                p, g = (torch.stack(ps), torch.stack(gs)) if stacked else (ps[0], gs[0])
                limit = unit_norms(p, self.norm_type, stacked).clamp_min(self.eps).mul_(self.clip_factor)
                unit = unit_norms(g, self.norm_type, stacked)
                coef = (limit / unit.clamp_min(EPS)).clamp_max(1.0)  # min(1, limit / max(|g|, 1e-6))
                if stacked:  # (unit norms have no foreach form)
                    torch._foreach_mul_(gs, list(coef.unbind(0)))
                else:
                    gs[0].mul_(coef)
                if from_units:
                    norms.append(unit.reshape(-1))
                    clipped.append((unit * coef).reshape(-1))
            if from_units:
                before = torch.linalg.vector_norm(torch.cat(norms))
                after = torch.linalg.vector_norm(torch.cat(clipped))
            else:
                after = total_norm(grads)
            self.record.add(before, after / (before + EPS))

    def _apply_sharded(self, params: list[Tensor], grads: list[Tensor]) -> None:
        """DTensors, tensor by tensor: unit norms combined over the mesh dimensions that cut
        a row (``reductions.unit_norms``), each rank scaling its piece's rows."""
        with torch.no_grad():
            before = total_norm(grads)
            for p, g in zip(params, grads):
                limit = mesh.unit_norms(p, self.norm_type).clamp_min(self.eps).mul_(self.clip_factor)
                unit = mesh.unit_norms(g, self.norm_type)
                mesh.local(g).mul_((limit / unit.clamp_min(EPS)).clamp_max(1.0))
            self.record.add(before, total_norm(grads) / (before + EPS))


def _by_shape(params: list[Tensor], grads: list[Tensor]) -> list[tuple[list[Tensor], list[Tensor]]]:
    """(params, grads) per shape; big or 0-d tensors alone (stacking them would copy much, or nothing to stack)."""
    groups: dict[Any, tuple[list[Tensor], list[Tensor]]] = {}
    for i, (p, g) in enumerate(zip(params, grads)):
        key = i if g.numel() >= BIG or g.dim() == 0 else (tuple(g.shape), g.dtype)
        groups.setdefault(key, ([], []))
        groups[key][0].append(p)
        groups[key][1].append(g)
    return list(groups.values())


class Freeze(GroupTransform):
    """The rule's parameters take no part in the backward while it acts: ``requires_grad``
    is off from the next forward (``gradmod.hooks.fused.trainability``), and a gradient that
    reaches one anyway (``zero_grad(set_to_none=False)``) is dropped here, ``.grad = None``: no
    momentum, weight decay or Adam step moves them (``zero`` would leave weight decay and
    the moments at work). With ``active`` it is a freeze window."""

    name = "freeze"
    switches_trainability = True

    def apply_(self, params: list[Tensor], grads: list[Tensor]) -> None:
        for p in params:
            p.grad = None
