"""The ``sharpness`` section of ``python -m benchmarks``: SAM's optimizer step against a plain one,
SGD with momentum, on one thread:

    plain        forward, loss.backward(), step
    sam          attach(model, {sam on "*"}), hooks.backward(loss, closure=...), after_backward, step
    sam_every4   the same with ``every: 4``: two passes on one step in four
    two_passes   the floor: two plain forward and backward passes into ``.grad``, one step

Models: ``mnist`` (gradmod's MNIST CNN, batch 100 of 28x28) and ``resnet18`` (gradmod's
torchvision ResNet-18 with BatchNorm, batch 32 of 3x32x32). Two forward and backward
passes are the floor of a SAM step, so ``sam`` over ``plain`` is near 2 (the optimizer
step is not doubled) and ``sam_every4`` near 1.25.

Peak memory: ``plain`` and ``sam`` run two steps each under a dispatch mode that counts the
bytes of live tensors (``peak_memory.live_tensor_peak``: the allocator's view, deterministic);
SAM's extra peak is divided by the bytes of one copy of the moved parameters (the copy the
stage restores them from): at most 1 is the target, give or take 1 KiB of scalars (the
first pass's loss is still alive in the second, as the step's reported loss). The growth of the resident set in a
fresh process is reported beside it (it also holds the heap's fragmentation):

    python -m benchmarks.sections.sharpness --peak resnet18.sam
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks import peak_memory
from gradmod.hooks import attach
from gradmod.models import build_model

STEPS = 4  # optimizer steps per timed run: one two-pass step of every4's
MODELS = {"mnist": ("mnist_cnn", 1, 28, 100), "resnet18": ("resnet18", 3, 32, 32)}  # name, channels, size, batch
CONTENDERS = ("plain", "sam", "sam_every4", "two_passes")
RHO = 0.05
SCALARS = 1024  # besides the copy, SAM's peak holds scalars: the first pass's loss, reported as the step's


def names() -> list[str]:
    return [f"{m}.{c}" for m in MODELS for c in CONTENDERS]


def _model(model_name: str):
    name, channels, size, _ = MODELS[model_name]
    torch.manual_seed(0)
    return build_model(name, in_channels=channels, num_classes=10, image_size=size)


def param_bytes(model_name: str) -> int:
    """One copy of the parameters SAM moves (every parameter: the rule is on "*")."""
    return sum(p.numel() * p.element_size() for p in _model(model_name).parameters())


def model_and_batches(model_name: str, steps: int, batch: int | None, device: str) -> tuple[nn.Module, list]:
    """The model on ``device`` and ``steps`` seeded batches of random images and labels for it
    (the same for every contender, here and in benchmarks/sections/sam_peers.py)."""
    _, channels, size, default_batch = MODELS[model_name]
    model = _model(model_name).to(device)
    gen = torch.Generator().manual_seed(1)
    n = batch or default_batch
    data = [
        (
            torch.randn(n, channels, size, size, generator=gen).to(device),
            torch.randint(0, 10, (n,), generator=gen).to(device),
        )
        for _ in range(steps)
    ]
    return model, data


def setup(name: str, steps: int = STEPS, batch: int | None = None, device: str = "cpu") -> Callable[[], None]:
    """Build the contender (untimed) and return its timed run of ``steps`` optimizer steps."""
    model_name, contender = name.split(".")
    model, data = model_and_batches(model_name, steps, batch, device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if contender in ("plain", "two_passes"):
        passes = 2 if contender == "two_passes" else 1

        def step(x, y):
            for _ in range(passes):
                F.cross_entropy(model(x), y).backward()
    else:
        every = 4 if contender == "sam_every4" else 1
        hooks = attach(model, {"sam": {"params": "*", "transforms": [{"name": "sam", "rho": RHO, "every": every}]}})

        def step(x, y):
            def loss():
                return F.cross_entropy(model(x), y)

            hooks.backward(loss(), closure=loss)
            hooks.after_backward()

    def run():
        for x, y in data:
            opt.zero_grad(set_to_none=True)
            step(x, y)
            opt.step()

    return run


def peak(name: str, steps: int = 2) -> int:
    """Bytes the peak resident set grows by over ``steps`` steps after the set-up."""
    return peak_memory.peak(setup(name, steps))


def memory(log=print, resident: bool = True, device: str = "cpu") -> dict[str, dict]:
    """Peak bytes of live tensors over two steps of plain and sam per model, SAM's extra over
    one copy of the parameters; ``resident``: each one's resident-set growth in a fresh process too."""
    peaks, ratios = {}, {}
    for m in MODELS:
        for c in ("plain", "sam"):
            name = f"{m}.{c}"
            peaks[name] = {"live_tensor_bytes": peak_memory.live_tensor_peak(setup(name, 2, device=device))}
            if resident:
                peaks[name]["resident_bytes"] = peak_memory.in_subprocess("benchmarks.sections.sharpness", name)
            log(f"  peak memory of {name}: " + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in peaks[name].items()))
        extra = peaks[f"{m}.sam"]["live_tensor_bytes"] - peaks[f"{m}.plain"]["live_tensor_bytes"]
        copy = param_bytes(m)
        ratios[f"sharpness_{m}_extra_peak_over_param_copy"] = {
            "value": extra / copy,
            "extra_bytes": extra,
            "copy_bytes": copy,
            "target": f"<= 1 (+ {SCALARS} bytes of scalars)",
            "met": extra <= copy + SCALARS,
        }
    return {"peak_bytes": peaks, "ratios": ratios}


if __name__ == "__main__":
    peak_memory.main(__doc__, peak)
