"""``orthogonalize``: Muon's update as a group transform, so that any optimizer can take it.

For each matrix of the rule, what ``torch.optim.Muon`` computes as its update:

1. momentum (``momentum > 0``): ``buf.lerp_(grad, 1 - momentum)``, then the update is
   ``grad.lerp(buf, momentum)`` with ``nesterov``, else ``buf``;
2. Newton-Schulz in bfloat16 (as torch's): ``X = update / max(||update||_F, eps)``, transposed
   when it has more rows than columns, then ``steps`` times ``A = X X^T``,
   ``X = a X + (b A + c A A) X`` with ``coefficients = (a, b, c)``;
3. ``adjust_lr``: times ``max(1, rows / cols) ** 0.5`` (``original``, Muon's default),
   ``0.2 * max(rows, cols) ** 0.5`` (``match_rms_adamw``), ``(rows / cols) ** 0.5``
   (``spectral_unclamped``) or 1 (``none``);

and writes the result into ``.grad``. SGD (no momentum, no weight decay) at ``lr`` then
steps as ``torch.optim.Muon(lr, weight_decay=0)``, and the rule's transforms before it
(a clip) act on the gradient the momentum receives.

Vectors and scalars are refused at attach, in one line naming them. A convolution kernel
``(out, in, *k)`` is orthogonalized as the matrix ``(out, in * prod(k))`` (Keller Jordan's
recipe; ``torch.optim.Muon`` refuses it), whose rows and columns ``adjust_lr`` reads.
A non-finite entry in any of the rule's gradients (a non-finite L2 norm) leaves every
momentum buffer as it was (as Muon's, whose step GradScaler skips); the update is then
non-finite, for the loop's guard to see.

DTensor gradients (FSDP2, tensor parallelism): each matrix is gathered whole on every rank,
its momentum kept whole on every rank (so rank 0's ``state_dict`` is everyone's), and every
rank orthogonalizes it and keeps its own piece: the same numbers as one process, at the
price of every rank computing every matrix.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from gradmod.hooks.fused.group import GroupTransform
from gradmod.hooks.mesh import reductions as mesh
from gradmod.hooks.mesh.sharded import is_sharded
from gradmod.hooks.validators import number, positive

COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's (Keller Jordan's) quintic
ADJUST_LR = ("original", "match_rms_adamw", "spectral_unclamped", "none")


def newton_schulz(matrix: Tensor, coefficients: Sequence[float], steps: int, eps: float) -> Tensor:
    """``matrix``'s orthogonalization (``U S' V^T``, ``S'`` near 1) in bfloat16, as
    ``torch.optim.Muon`` computes it: the wide orientation, the Frobenius norm at most 1,
    then ``steps`` quintic iterations."""
    a, b, c = coefficients
    x = matrix.to(torch.bfloat16, copy=True)  # a copy: the momentum buffer is never touched
    tall = matrix.size(0) > matrix.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    return x.T if tall else x


def lr_ratio(adjust_lr: str, rows: int, cols: int) -> float:
    """The factor on a ``rows x cols`` update that SGD's ``lr`` turns into Muon's adjusted one."""
    if adjust_lr == "original":
        return math.sqrt(max(1, rows / cols))
    if adjust_lr == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    if adjust_lr == "spectral_unclamped":
        return math.sqrt(rows / cols)
    return 1.0


class Orthogonalize(GroupTransform):
    """Muon's update (momentum, Newton-Schulz, the adjusted scale) written into each matrix's gradient.

    SGD without momentum or weight decay then steps as torch.optim.Muon with weight_decay=0;
    convolution kernels are taken as (out, -1), vectors refused."""

    name = "orthogonalize"

    def __init__(
        self,
        steps: int = 5,
        coefficients: Sequence[float] = COEFFICIENTS,
        eps: float = 1e-7,
        momentum: float = 0.95,
        nesterov: bool = True,
        adjust_lr: str = "original",
    ):
        super().__init__()
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"transform 'orthogonalize': steps={steps!r} must be an int >= 1 (Newton-Schulz steps)")
        if isinstance(coefficients, (str, Mapping)) or not isinstance(coefficients, Sequence) or len(coefficients) != 3:
            raise ValueError(f"transform 'orthogonalize': coefficients={coefficients!r} must be 3 numbers (a, b, c)")
        self.coefficients = tuple(number(self.name, "coefficients", c) for c in coefficients)
        self.eps = positive(self.name, "eps", eps, allow_zero=False)
        self.momentum = number(self.name, "momentum", momentum)
        if not 0 <= self.momentum < 1:
            raise ValueError(f"transform 'orthogonalize': momentum={momentum!r} must be in [0, 1)")
        if not isinstance(nesterov, bool):
            raise ValueError(f"transform 'orthogonalize': nesterov={nesterov!r} must be true or false")
        if adjust_lr not in ADJUST_LR:
            raise ValueError(f"transform 'orthogonalize': adjust_lr={adjust_lr!r}; allowed: {', '.join(ADJUST_LR)}")
        self.steps, self.nesterov, self.adjust_lr = steps, nesterov, adjust_lr
        self._names: dict[int, str] = {}  # id(parameter) -> its name
        self._shapes: dict[str, tuple[int, ...]] = {}
        self.buffers: dict[str, Tensor] = {}  # name -> momentum buffer (whole, also under FSDP2)

    def bind(self, rule: str, named: Mapping[str, Tensor]) -> None:
        """Refuse a vector or a scalar in one line; keep the names the momentum is saved by."""
        for name, p in named.items():
            if p.dim() < 2:
                raise ValueError(
                    f"hooks.{rule}: orthogonalize acts on matrices, and {name!r} has shape {tuple(p.shape)}; "
                    "allowed: tensors of 2 or more dims (a conv kernel as (out, -1)); leave the others out "
                    'with exclude, or select params: "@matrices"'
                )
            self._names[id(p)] = name
            self._shapes[name] = tuple(p.shape)

    def apply_(self, params: list[Tensor], grads: list[Tensor]) -> None:
        with torch.no_grad():
            names = [self._name(p) for p in params]
            finite = all_finite(grads) if self.momentum else None
            local = [i for i, g in enumerate(grads) if not is_sharded(g)]
            if local:  # the momentum of all of them in a few foreach ops
                updates = self._updates([names[i] for i in local], [grads[i] for i in local], finite)
                for i, u in zip(local, updates):
                    out, ratio = self._orthogonal(u)
                    grads[i].copy_(out.reshape(grads[i].shape))  # bfloat16 into .grad's dtype: exact
                    if ratio != 1.0:
                        grads[i].mul_(ratio)
            for i, g in enumerate(grads):  # one whole matrix at a time: memory for one
                if is_sharded(g):
                    (u,) = self._updates([names[i]], [mesh.settled(g).full_tensor()], finite)
                    out, ratio = self._orthogonal(u)
                    _keep_piece(g, out.reshape(g.shape), ratio)

    def _name(self, p: Tensor) -> str:
        """The parameter's name from ``bind``; called without ``attach``, its position."""
        if id(p) not in self._names:
            self.bind(self.name, {f"#{len(self._names)}": p})
        return self._names[id(p)]

    def _updates(self, names: list[str], grads: list[Tensor], finite: Tensor | None) -> list[Tensor]:
        """The momentum step of Muon; where ``finite`` is False every buffer stays as it was."""
        if self.momentum == 0:  # Muon's buffer would be the gradient itself, to the bit
            return grads
        assert finite is not None
        bufs = [self._buffer(n, g) for n, g in zip(names, grads)]
        torch._foreach_lerp_(bufs, [torch.where(finite, g, b) for g, b in zip(grads, bufs)], 1 - self.momentum)
        return list(torch._foreach_lerp(grads, bufs, self.momentum)) if self.nesterov else bufs

    def _buffer(self, name: str, grad: Tensor) -> Tensor:
        buf = self.buffers.get(name)
        if buf is None:
            buf = self.buffers[name] = torch.zeros_like(grad, memory_format=torch.preserve_format)
        elif buf.device != grad.device:  # loaded without a device
            buf = self.buffers[name] = buf.to(grad.device)
        return buf

    def _orthogonal(self, update: Tensor) -> tuple[Tensor, float]:
        """The orthogonalized ``(out, -1)`` matrix of ``update`` (bfloat16) and its factor."""
        matrix = update.reshape(update.shape[0], -1)
        rows, cols = matrix.shape
        return newton_schulz(matrix, self.coefficients, self.steps, self.eps), lr_ratio(self.adjust_lr, rows, cols)

    def state_dict(self) -> dict[str, Any]:
        # Copies: the live buffers change in place at every step.
        return {"momentum": {name: buf.clone() for name, buf in self.buffers.items()}}

    def load_state_dict(self, state: Mapping[str, Any], device: torch.device | None = None) -> None:
        buffers = {}
        for name, buf in state.get("momentum", {}).items():
            shape = self._shapes.get(name)
            if shape is not None and tuple(buf.shape) != shape:
                raise ValueError(
                    f"orthogonalize: the momentum of {name!r} has shape {tuple(buf.shape)}, "
                    f"the parameter {shape}; load it into the model it was saved from"
                )
            buffers[name] = (buf if device is None else buf.to(device)).clone()
        self.buffers = buffers


def all_finite(grads: list[Tensor]) -> Tensor:
    """A device bool: every gradient's L2 norm finite, so every entry (and no square sum past
    float32's range, entries near 1e19). DTensors: on every rank; one all-reduce over the
    world, which runs the fused stage on every rank. (The L2 norm: 20x faster than the
    largest entry's on the CPU.)"""
    pieces = [p for p in (mesh.local(g) for g in grads) if p.numel()]  # an uneven cut leaves some empty
    device = mesh.local(grads[0]).device
    if pieces:
        norms = torch.stack([n.to(device).float() for n in torch._foreach_norm(pieces)])
        bad = (~norms.isfinite()).any().float()
    else:
        bad = torch.zeros((), device=device)
    if any(is_sharded(g) for g in grads):
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return bad == 0


def _keep_piece(grad: Tensor, whole: Tensor, ratio: float) -> None:
    """Write this rank's piece of ``whole`` (the full update, the same on every rank) into
    the DTensor ``grad``, in its layout: a replicated DTensor redistributed to ``grad``'s
    placements is each rank's slice, no communication."""
    from torch.distributed.tensor import DTensor, Replicate

    device_mesh = grad.device_mesh
    replicated = DTensor.from_local(
        whole.to(grad.dtype), device_mesh, [Replicate()] * device_mesh.ndim, run_check=False
    )
    piece = mesh.local(grad)
    piece.copy_(replicated.redistribute(device_mesh, grad.placements).to_local())
    if ratio != 1.0:
        piece.mul_(ratio)
