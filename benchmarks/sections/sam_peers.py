"""The ``sam_peers`` section of ``python -m benchmarks``: each of gradmod's SAM-family rules against
pytorch-optimizer 4.1.0's optimizer for the same method, SGD with momentum, one optimizer
step at a time, as each library's documentation writes the loop:

    gradmod      attach(model, {rule on "*"}), hooks.backward(loss, closure=...), after_backward, step
    pytorch_optimizer  GSAM: set_closure, step(), the LR scheduler, update_rho_t(); WSAM: step(closure);
                 SAM(use_gc=True), LookSAM, FriendlySAM: the gradient at w, then step(closure)
    plain        forward, loss.backward(), step (the base of LookSAM's <= 1.3x at k=5)

Methods: ``gsam`` (rho following a cosine learning rate), ``wsam`` (decoupled), ``looksam``
(k=5: a timed run of 5 steps holds one two-pass step), ``friendly_sam`` and ``sam_gc``
(centralize before sam). Models: ``mnist`` (gradmod's MNIST CNN, batch 100 of 28x28) and
``resnet18`` (torchvision's ResNet-18 with BatchNorm, batch 32 of 3x32x32), as the
``sharpness`` section's.

On a loaded machine the section's ratios move from run to run (each contender runs while the
neighbours' load changes); the two sides of each method taking turns, step block by step
block, give steadier ones:

    python -m benchmarks.sections.sam_peers --rounds 7 [--models resnet18] [--methods gsam,looksam]
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from benchmarks.sections.sharpness import MODELS, model_and_batches
from gradmod.hooks import attach

STEPS = 5  # optimizer steps per timed run: LookSAM's k
LR, RHO = 0.01, 0.05
METHODS = {  # gradmod's rule transforms; pytorch-optimizer's class and arguments
    "gsam": ([{"name": "gsam", "rho": RHO, "alpha": 0.4, "rho_min": 0.0, "lr_max": LR}], "GSAM", {"alpha": 0.4}),
    "wsam": ([{"name": "wsam", "rho": RHO, "gamma": 0.9}], "WSAM", {"rho": RHO, "gamma": 0.9}),
    "looksam": ([{"name": "looksam", "rho": RHO, "k": 5, "alpha": 0.7}], "LookSAM", {"rho": RHO, "k": 5, "alpha": 0.7}),
    "friendly_sam": ([{"name": "friendly_sam", "rho": RHO}], "FriendlySAM", {"rho": RHO}),
    "sam_gc": (["centralize", {"name": "sam", "rho": RHO}], "SAM", {"rho": RHO, "use_gc": True}),
}
CONTENDERS = ("plain", *(f"{m}_{side}" for m in METHODS for side in ("gradmod", "pytorch_optimizer")))


def names() -> list[str]:
    return [f"{m}.{c}" for m in MODELS for c in CONTENDERS]


def ratios() -> list[tuple]:
    """(name, numerator, denominator, target, test) for the table of ``python -m benchmarks``."""
    out: list[tuple] = []
    for m in MODELS:
        for method in METHODS:
            num, den = f"sam_peers.{m}.{method}_gradmod", f"sam_peers.{m}.{method}_pytorch_optimizer"
            out.append((f"sam_peers_{m}_{method}_over_pytorch_optimizer", num, den, "<= 1.05", lambda r: r <= 1.05))
        for side in ("gradmod", "pytorch_optimizer"):
            num, den = f"sam_peers.{m}.looksam_{side}", f"sam_peers.{m}.plain"
            target = ("<= 1.3", lambda r: r <= 1.3) if side == "gradmod" and m == "resnet18" else (None, None)
            out.append((f"sam_peers_{m}_looksam_{side}_over_plain", num, den, *target))
    return out


def setup(name: str, steps: int = STEPS, batch: int | None = None, device: str = "cpu") -> Callable[[], None]:
    """Build the contender (untimed) and return its timed run of ``steps`` optimizer steps."""
    model_name, contender = name.split(".")
    model, data = model_and_batches(model_name, steps, batch, device)
    if contender == "plain":
        step = _plain(model)
    elif contender.endswith("_gradmod"):
        step = _gradmod(model, contender.removesuffix("_gradmod"))
    else:
        step = _peer(model, contender.removesuffix("_pytorch_optimizer"))

    def run():
        for x, y in data:
            step(x, y)

    return run


def _sgd(params):
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def _plain(model) -> Callable:
    opt = _sgd(model.parameters())

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()

    return step


def _gradmod(model, method: str) -> Callable:
    opt = _sgd(model.parameters())
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10_000)
    hooks = attach(model, {method: {"params": "*", "transforms": METHODS[method][0]}})
    hooks.stage("sharpness").set_optimizer(opt)

    def step(x, y):
        def loss():
            return F.cross_entropy(model(x), y)

        opt.zero_grad(set_to_none=True)
        hooks.backward(loss(), closure=loss)
        hooks.after_backward()
        opt.step()
        sched.step()

    return step


def _peer(model, method: str) -> Callable:
    import pytorch_optimizer as po

    _, cls, kwargs = METHODS[method]
    if cls == "GSAM":
        base = _sgd(model.parameters())
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(base, T_max=10_000)
        rho = po.ProportionScheduler(sched, max_lr=LR, min_lr=0.0, max_value=RHO, min_value=0.0)
        opt = po.GSAM(model.parameters(), base, model, rho, **kwargs)

        def gsam_step(x, y):
            opt.set_closure(F.cross_entropy, x, y)
            opt.step()
            sched.step()
            opt.update_rho_t()

        return gsam_step
    if cls == "WSAM":  # WSAM takes the model too
        opt = po.WSAM(model, model.parameters(), torch.optim.SGD, **kwargs, lr=LR, momentum=0.9)
    else:
        opt = getattr(po, cls)(model.parameters(), torch.optim.SGD, **kwargs, lr=LR, momentum=0.9)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt.base_optimizer, T_max=10_000)

    def step(x, y):
        def closure():
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            return loss

        opt.zero_grad(set_to_none=True)
        if cls != "WSAM":  # WSAM's step takes the gradient at w itself
            closure()
        opt.step(closure)
        sched.step()

    return step


def paired(model: str, method: str, rounds: int, steps: int = STEPS) -> dict[str, float]:
    """gradmod's rule and the library's optimizer (and, for looksam, a plain step) taking
    turns, ``steps`` optimizer steps each per turn, the order reversed every other round; the
    median over rounds of each one's CPU time over the library's (a slow drift of the machine's
    load hits both sides of a round alike)."""
    import statistics
    import time

    sides = {"gradmod": f"{model}.{method}_gradmod", "pytorch_optimizer": f"{model}.{method}_pytorch_optimizer"}
    if method == "looksam":
        sides["plain"] = f"{model}.plain"
    runs = {side: setup(name, steps) for side, name in sides.items()}
    for run in runs.values():  # warm-up
        run()
    seconds: dict[str, list[float]] = {side: [] for side in runs}
    for r in range(rounds):
        for side in list(runs)[:: -1 if r % 2 else 1]:
            t0 = time.process_time()
            runs[side]()
            seconds[side].append(time.process_time() - t0)
    out = {
        "gradmod_over_pytorch_optimizer": statistics.median(
            a / b for a, b in zip(seconds["gradmod"], seconds["pytorch_optimizer"])
        )
    }
    if "plain" in runs:
        for side in ("gradmod", "pytorch_optimizer"):
            out[f"{side}_over_plain"] = statistics.median(a / b for a, b in zip(seconds[side], seconds["plain"]))
    return out


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description="gradmod's SAM-family rules and pytorch-optimizer's, taking turns")
    p.add_argument("--rounds", type=int, default=5, help="turns of each side (default 5)")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {','.join(MODELS)}")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated subset of {','.join(METHODS)}")
    args = p.parse_args()
    torch.set_num_threads(1)
    for m in args.models.split(","):
        for method in args.methods.split(","):
            ratios_ = paired(m, method, args.rounds)
            print(f"{m:<9} {method:<13} " + "  ".join(f"{k} {v:.3f}" for k, v in ratios_.items()), flush=True)
