"""Mixed precision: ``trainer.precision=fp32|bf16|fp16``.

* ``bf16``: autocast, no scaler (bf16 has fp32's exponent range).
* ``fp16``: autocast and ``torch.amp.GradScaler``. The loss is scaled before backward, so
  raw gradients are scaled. Hook-stage transforms are made scale-aware
  (``HookSet.set_grad_scale``: they see the unscaled gradient, as in fp32); the fused stage
  runs after ``unscale_``. A step GradScaler finds non-finite is skipped and the scale
  halved, as GradScaler always does.
"""

from __future__ import annotations

import warnings
from contextlib import nullcontext
from typing import Iterable, Mapping

import torch

from gradmod.hooks.losses import total

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def check_precision(name: str, device: torch.device) -> None:
    """A ``ValueError`` when this torch cannot autocast to ``name`` on ``device``."""
    dtype = DTYPES.get(name)
    if name not in DTYPES:
        raise ValueError(f"trainer.precision={name!r} is not allowed; allowed: {', '.join(DTYPES)}")
    if dtype is None:
        return
    with warnings.catch_warnings(record=True):  # unsupported CPU dtypes only warn and disable autocast
        warnings.simplefilter("always")
        try:
            with torch.autocast(device.type, dtype=dtype):
                out = torch.nn.functional.linear(torch.ones(2, 2, device=device), torch.ones(2, 2, device=device))
            ok = out.dtype == dtype
        except (RuntimeError, TypeError, ValueError):
            ok = False
    if not ok:
        raise ValueError(
            f"trainer.precision={name} is not supported on {device} by torch {torch.__version__}; "
            "use trainer.precision=fp32" + (" or bf16" if name == "fp16" else "")
        )


class Precision:
    """Autocast, backward, unscale and step for one precision on one device."""

    def __init__(self, name: str, device: torch.device):
        check_precision(name, torch.device(device))
        self.name = name
        self.device_type = torch.device(device).type
        self.dtype = DTYPES[name]
        self.scaler = torch.amp.GradScaler(self.device_type) if name == "fp16" else None

    def autocast(self):
        return nullcontext() if self.dtype is None else torch.autocast(self.device_type, dtype=self.dtype)

    def backward(self, losses: torch.Tensor | Mapping[str, torch.Tensor], hooks=None, closure=None) -> None:
        """Backward of one loss or several named ones, each scaled under fp16, through
        ``hooks.backward`` when there are hooks (a per_loss stage aggregates the tasks'
        gradients there; it reads ``hooks.grad_scale`` to see them unscaled). ``closure``:
        the losses recomputed at the current parameters, for a sharpness stage's second
        pass (scaled the same way)."""
        scaler = self.scaler
        if scaler is not None:
            losses = _scaled(scaler, losses)  # creates the scale tensor on first use
            if hooks is not None:
                hooks.set_grad_scale(_scale_tensor(scaler, next(iter(_values(losses))).device))
            if closure is not None:
                unscaled = closure
                closure = lambda: _scaled(scaler, unscaled())  # noqa: E731
        if hooks is not None:
            hooks.backward(losses, closure=closure) if closure is not None else hooks.backward(losses)
            return
        total(losses).backward()

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def scale(self) -> float | None:
        """The current loss scale (a host sync; fp16 syncs every step anyway), or None."""
        return None if self.scaler is None else self.scaler.get_scale()

    def step(self, optimizer: torch.optim.Optimizer, skip: bool = False) -> None:
        if self.scaler is None:
            if not skip:
                optimizer.step()
            return
        if skip:
            # A hook-stage transform may have hidden the inf from GradScaler: back off here.
            self.scaler.update(self.scaler.get_scale() * self.scaler.get_backoff_factor())
        else:
            self.scaler.step(optimizer)
            self.scaler.update()

    def state_dict(self) -> dict:
        return {} if self.scaler is None else self.scaler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)


def _scale_tensor(scaler: torch.amp.GradScaler, device: torch.device) -> torch.Tensor:
    scale = getattr(scaler, "_scale", None)  # the device tensor GradScaler updates in place
    if scale is None:
        scale = torch.tensor(scaler.get_scale(), device=device)
    return scale.reshape(())


def _values(losses: torch.Tensor | Mapping[str, torch.Tensor]) -> Iterable[torch.Tensor]:
    return [losses] if isinstance(losses, torch.Tensor) else losses.values()


def _scaled(scaler: torch.amp.GradScaler, losses: torch.Tensor | Mapping[str, torch.Tensor]):
    if isinstance(losses, torch.Tensor):
        return scaler.scale(losses)
    return {k: scaler.scale(v) for k, v in losses.items()}
