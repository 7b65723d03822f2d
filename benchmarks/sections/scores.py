"""The ``scores`` section of ``python -m benchmarks``: a training step that keeps every example's GraNd
and EL2N against the plain step.

    plain   forward, cross-entropy, loss.backward(), Adam step
    scores  the same with attach(model, {params: "*", stage: per_sample, transforms: [scores]}):
            see_batch(index, labels) before the forward, hooks.after_backward() before the step

Models: the MNIST CNN (batch 100, 1x28x28) and torchvision's ResNet-18 with GroupNorm (batch 32,
3x32x32, benchmarks/sections/per_sample.py's). No extra backward: the norms come from the per_sample
stage's closed forms and Gram norms, EL2N from the outputs; target <= 1.3x the plain step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from benchmarks.sections.per_sample import resnet18_gn
from gradmod.hooks import attach
from gradmod.models import MnistCNN

STEPS = 4  # optimizer steps per timed run
MODELS = {"mnist": (MnistCNN, (1, 28, 28), 100), "resnet18gn": (resnet18_gn, (3, 32, 32), 32)}
CONTENDERS = ("plain", "scores")
SCORES = {"scores": {"params": "*", "stage": "per_sample", "transforms": ["scores"]}}


def names() -> list[str]:
    return [f"{m}.{c}" for m in MODELS for c in CONTENDERS]


def setup(name: str, steps: int = STEPS, device: str = "cpu") -> Callable[[], None]:
    """Build the contender (untimed) and return its timed run of ``steps`` optimizer steps."""
    model_name, contender = name.split(".")
    build, shape, batch = MODELS[model_name]
    torch.manual_seed(0)
    model = build().to(device)
    gen = torch.Generator().manual_seed(1)
    data = [
        (
            torch.randn(batch, *shape, generator=gen).to(device),
            torch.randint(0, 10, (batch,), generator=gen).to(device),
            torch.randperm(10 * batch, generator=gen)[:batch].to(device),
        )
        for _ in range(steps)
    ]
    hooks = attach(model, SCORES) if contender == "scores" else None
    stage = hooks.stage("per_sample") if hooks is not None else None
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def run():
        for x, y, index in data:
            opt.zero_grad(set_to_none=True)
            if stage is not None:
                stage.see_batch(index, y)
            F.cross_entropy(model(x), y).backward()
            if hooks is not None:
                hooks.after_backward()
            opt.step()
        if stage is not None:
            stage.take_scores()  # what the trainer does once an epoch: one host read

    return run
