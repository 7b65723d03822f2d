"""The ``curvature`` section of ``python -m benchmarks``: what a curvature rule at ``every: 100`` adds
to training, and one estimate's cost in Hessian-vector products.

    plain     100 SGD steps (momentum 0.9, lr 0.01)
    every100  the same 100 steps and one estimate (the shipped rule's settings: the top eigenvalue
              of every parameter by Lanczos, at most 20 steps to a relative residual of 5e-3, on a
              fixed probe batch of the training batch's size, warm-started from the last estimate as
              a run's are)

Models: the MNIST CNN (batch 100 of 28x28) and torchvision's ResNet-18 with BatchNorm (batch 32 of
3x32x32). ``every100`` over ``plain`` is the cost of a run at ``every: 100``; target <= 1.10. Asked
for by name (it runs 100 steps per contender). The products each timed estimate took are printed
under the table and kept in the report (``curvature_products``): the ratio of a repeat follows them.

    python -m benchmarks.sections.curvature [MODEL ...]   # alone: each estimate's cost, timed apart
                                                          # from the drift between runs (one thread)
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from gradmod.hooks import curvature
from gradmod.models import build_model
from gradmod.run import host_heap

EVERY = 100  # optimizer steps per timed run: one estimate's period
MODELS = {"mnist": ("mnist_cnn", 1, 28, 100), "resnet18": ("resnet18", 3, 32, 32)}  # name, channels, size, batch
CONTENDERS = ("plain", "every100")
SETTINGS = {"k": 1, "iterations": 20, "tol": 5e-3}  # gradmod/conf/hooks/curvature.yaml's
PRODUCTS: dict[str, list[int]] = {}  # model -> the products of each run's estimate, in the order they ran


def names() -> list[str]:
    return [f"{m}.{c}" for m in MODELS for c in CONTENDERS]


def _model_and_batches(model_name: str, device: str, batch: int | None):
    name, channels, size, default = MODELS[model_name]
    torch.manual_seed(0)
    model = build_model(name, in_channels=channels, num_classes=10, image_size=size).to(device)
    gen = torch.Generator().manual_seed(1)
    n = batch or default
    batches = [
        (
            torch.randn(n, channels, size, size, generator=gen).to(device),
            torch.randint(0, 10, (n,), generator=gen).to(device),
        )
        for _ in range(4)
    ]
    return model, batches


def setup(name: str, steps: int = EVERY, device: str = "cpu", batch: int | None = None) -> Callable[[], None]:
    """Build the contender (untimed: a first estimate, the next one's warm start) and return its
    timed run of ``steps`` optimizer steps."""
    model_name, contender = name.split(".")
    model, batches = _model_and_batches(model_name, device, batch)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    probe = batches[0]
    warm = {"last": curvature(model, F.cross_entropy, probe, "*", **SETTINGS)} if contender == "every100" else {}

    def run():
        if contender == "every100":
            warm["last"] = curvature(model, F.cross_entropy, probe, "*", warm=warm["last"], **SETTINGS)
            PRODUCTS.setdefault(model_name, []).append(warm["last"]["*"].hvps)
        _train(model, opt, batches, steps)

    return run


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, batches: list, steps: int, first: int = 0) -> None:
    """``steps`` SGD steps on the batches in turn, from the ``first``-th."""
    model.train()
    for i in range(first, first + steps):
        x, y = batches[i % len(batches)]
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()


def interleaved(
    model_name: str, rounds: int = 4, every: int = EVERY, window: int = 10, device: str = "cpu"
) -> list[dict]:
    """An estimate's cost apart from the machine's drift between timed runs: two copies of the model
    train side by side in alternating windows of ``window`` steps, the second estimating (warm) before
    each ``every`` steps. Per round: the estimate's products and CPU seconds, the plain copy's CPU
    seconds per step, the estimating copy's steps over the plain copy's (what an estimate leaves
    behind), and what a run at ``every`` then costs: 1 + the estimate over ``every`` plain steps."""
    pair = [_model_and_batches(model_name, device, None) for _ in range(2)]
    opts = [torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9) for model, _ in pair]
    probe = pair[1][1][0]
    last = curvature(pair[1][0], F.cross_entropy, probe, "*", **SETTINGS)
    done = [0, 0]

    def steps(which: int, n: int) -> float:
        (model, batches), start = pair[which], time.process_time()
        _train(model, opts[which], batches, n, done[which])
        done[which] += n
        return time.process_time() - start

    out = []
    for _ in range(rounds):
        start = time.process_time()
        last = curvature(pair[1][0], F.cross_entropy, probe, "*", warm=last, **SETTINGS)
        estimate = time.process_time() - start
        plain = estimating = 0.0
        for _ in range(every // window):
            plain += steps(0, window)
            estimating += steps(1, window)
        step = plain / (every // window * window)
        out.append(
            {
                "products": last["*"].hvps,
                "estimate_s": estimate,
                "plain_step_s": step,
                "after": estimating / plain,
                "every": 1 + estimate / (every * step),
            }
        )
    return out


if __name__ == "__main__":
    torch.set_num_threads(1)  # as the ratios in docs/performance.md are read: one thread, the trainer's heap
    host_heap.keep()
    for m in sys.argv[1:] or list(MODELS):
        for r, row in enumerate(interleaved(m), 1):
            print(
                f"{m} estimate {r} (step {r * EVERY - EVERY}): {row['products']} products, {row['estimate_s']:.2f} s "
                f"= {row['estimate_s'] / row['plain_step_s']:.1f} plain steps of {row['plain_step_s']:.3f} s; "
                f"the steps after it {row['after']:.3f}x the plain copy's; every: {EVERY} costs {row['every']:.3f}x",
                flush=True,
            )
