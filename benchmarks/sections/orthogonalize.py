"""The ``orthogonalize`` section of ``python -m benchmarks``: the update of a Muon step, by torch and by
gradmod, on the same gradients:

    muon           torch.optim.Muon(lr=0.02, weight_decay=0).step()
    orthogonalize  HookSet.after_backward() (orthogonalize on every matrix), then
                   torch.optim.SGD(lr=0.02).step(): the same update

Each step first copies the same stored gradients into ``.grad`` (one foreach copy, in both),
so every step orthogonalizes the same numbers; the forward and backward, alike in both, are
left out, so the ratio is that of the updates alone. Momentum 0.95 with Nesterov, ``adjust_lr``
original: torch's defaults. On the CPU each run takes one thread (two threads on small
bfloat16 matrix products mostly wait for each other).

Models: three blocks of an MLP with a hidden width ``w``, the matrices a transformer block
holds: ``w x w``, ``4w x w`` (tall: transposed in Newton-Schulz) and ``w x 4w``. ``w`` is
128, 256 and 512 on the CPU; 1024, 2048 and 4096 on a GPU.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from gradmod.hooks import attach

STEPS = 2  # optimizer steps per timed run
MODELS = {"small": (128, 1024), "medium": (256, 2048), "large": (512, 4096)}  # width on the CPU, on a GPU
CONTENDERS = ("muon", "orthogonalize")
LR = 0.02


def names() -> list[str]:
    return [f"{m}.{c}" for m in MODELS for c in CONTENDERS]


def width(model_name: str, device: str) -> int:
    cpu, gpu = MODELS[model_name]
    return cpu if torch.device(device).type == "cpu" else gpu


def _model(w: int, device: str) -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Linear(w, w, bias=False), nn.Linear(w, 4 * w, bias=False), nn.Linear(4 * w, w, bias=False)]
    return nn.Sequential(*layers).to(device)


def setup(name: str, steps: int = STEPS, device: str = "cpu") -> Callable[[], None]:
    """Build the contender (untimed) and return its timed run of ``steps`` updates."""
    model_name, contender = name.split(".")
    model = _model(width(model_name, device), device)
    params = list(model.parameters())
    gen = torch.Generator().manual_seed(1)
    stored = [(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5).to(device) for p in params]
    for p, g in zip(params, stored):
        p.grad = g.clone()
    if contender == "muon":
        opt = torch.optim.Muon(params, lr=LR, weight_decay=0)

        def update() -> None:
            opt.step()
    else:
        hooks = attach(model, {"o": {"params": "*", "transforms": ["orthogonalize"]}})
        sgd = torch.optim.SGD(params, lr=LR)

        def update() -> None:
            hooks.after_backward()
            sgd.step()

    grads = [p.grad for p in params]
    one_thread = torch.device(device).type == "cpu"

    def run():
        threads = torch.get_num_threads()
        if one_thread:
            torch.set_num_threads(1)
        try:
            for _ in range(steps):
                torch._foreach_copy_(grads, stored)
                update()
        finally:
            torch.set_num_threads(threads)

    return run
