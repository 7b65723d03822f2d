"""The ``freeze`` section of ``python -m benchmarks``: a frozen backbone's step, by a rule and by hand.

    plain    requires_grad=False set by hand on every parameter but ``fc``'s; forward,
             loss.backward(), AdamW step (weight decay 0.01)
    rule     every parameter trainable; attach(model, {params: "*", exclude: "@last_layer",
             transforms: [freeze], active: {until: ...}}), hooks.after_backward() before the step
    all      nothing frozen: what the frozen backbone saves

Model: torchvision's ResNet-18 (weights=None, 10 classes), batch 16 of 3x32x32.
The rule switches ``requires_grad`` off at the next forward, so its step is the hand-frozen
one's: ``rule`` over ``plain`` near 1 (it was 3.5x while the rule computed the frozen
gradients and dropped them).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from gradmod.hooks import attach

STEPS = 4  # optimizer steps per timed run
BATCH, SIZE = 16, 32
CONTENDERS = ("plain", "rule", "all")
FREEZE = {"backbone": {"params": "*", "exclude": "@last_layer", "transforms": ["freeze"], "active": {"until": 10**9}}}


def names() -> list[str]:
    return [f"resnet18.{c}" for c in CONTENDERS]


def setup(name: str, steps: int = STEPS, batch: int = BATCH, device: str = "cpu") -> Callable[[], None]:
    """Build the contender (untimed) and return its timed run of ``steps`` optimizer steps."""
    import torchvision

    contender = name.split(".")[1]
    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None, num_classes=10).to(device)
    gen = torch.Generator().manual_seed(1)
    data = [
        (
            torch.randn(batch, 3, SIZE, SIZE, generator=gen).to(device),
            torch.randint(0, 10, (batch,), generator=gen).to(device),
        )
        for _ in range(steps)
    ]
    if contender == "plain":
        for n, p in model.named_parameters():
            p.requires_grad_(n.startswith("fc."))
    hooks = attach(model, FREEZE) if contender == "rule" else None
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)

    def run():
        for x, y in data:
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            if hooks is not None:
                hooks.after_backward()
            opt.step()

    return run
