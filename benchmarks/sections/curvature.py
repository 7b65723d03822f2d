"""The ``curvature`` section of ``python -m benchmarks``: what a curvature rule at ``every: 100`` adds
to training, and one estimate's cost in Hessian-vector products.

    plain     100 SGD steps (momentum 0.9, lr 0.01)
    every100  the same 100 steps and one estimate (the shipped rule's settings: the top eigenvalue
              of every parameter by Lanczos, at most 20 steps to a relative residual of 5e-3, on a
              fixed probe batch of the training batch's size, warm-started from the last estimate as
              a run's are)
    run       a whole run of 2,000 steps at ``every: 100`` (21 estimates, the first cold) beside a
              plain copy in alternating windows of 10 steps (``run_cost``): the target, <= 1.10x; each
              estimate's line also gives the run's ratio up to it (at 500 steps: the first two
              estimates, 10 to 20 plain steps each, still weigh)

Models: the MNIST CNN (batch 100 of 28x28) and torchvision's ResNet-18 with BatchNorm (batch 32 of
3x32x32). ``every100`` over ``plain`` is one window's cost, its estimate warm; blocks of a minute
each drift by several percent on a shared machine, which the run's alternating windows cancel. Asked
for by name. The products each estimate took are printed and kept in the report
(``curvature_products``, ``curvature_runs``).

    python -m benchmarks.sections.curvature [MODEL ...]   # alone: the run (one thread)
"""

from __future__ import annotations

import fnmatch
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from gradmod.hooks import curvature
from gradmod.models import build_model
from gradmod.run import host_heap

EVERY = 100  # optimizer steps per timed run: one estimate's period
ROUNDS = 20  # periods in the timed run: 2,000 steps (the MNIST article trains 6,000; a CIFAR-10 epoch: 1,563)
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


def run_cost(model_name: str, rounds: int = ROUNDS, every: int = EVERY, window: int = 10, device: str = "cpu") -> dict:
    """What a run of ``rounds * every`` steps at ``every`` costs, apart from the machine's drift: two
    copies of the model train side by side in alternating windows of ``window`` steps (which goes first
    alternating too), the second estimating as gradmod's trainer does (cold at step 0, then warm after
    every ``every``-th step, the last one included). ``estimates``: each one's step, products and CPU
    seconds (also in plain steps), and ``run_ratio``, the run's ratio up to it (None at step 0);
    ``after``: the estimating copy's steps over the plain copy's (what estimates leave behind);
    ``ratio``: the run's CPU time (its steps and estimates) over the plain copy's."""
    pair = [_model_and_batches(model_name, device, None) for _ in range(2)]
    opts = [torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9) for model, _ in pair]
    probe, clock, spent = pair[1][1][0], [0.0, 0.0], 0.0
    last: dict | None = None

    def estimate(step: int) -> dict:
        nonlocal last, spent
        start = time.process_time()
        last = curvature(pair[1][0], F.cross_entropy, probe, "*", warm=last, **SETTINGS)
        seconds = time.process_time() - start
        spent += seconds
        ratio = (clock[1] + spent) / clock[0] if clock[0] else None
        return {"step": step, "products": last["*"].hvps, "estimate_s": seconds, "run_ratio": ratio}

    estimates = [estimate(0)]
    for r in range(rounds):
        for w in range(every // window):
            for which in (0, 1) if w % 2 == 0 else (1, 0):
                start = time.process_time()
                _train(pair[which][0], opts[which], pair[which][1], window, r * every + w * window)
                clock[which] += time.process_time() - start
        estimates.append(estimate((r + 1) * every))
    step = clock[0] / (rounds * (every // window) * window)
    for row in estimates:
        row["plain_steps"] = row["estimate_s"] / step
    return {
        "every": every,
        "estimates": estimates,
        "plain_step_s": step,
        "after": clock[1] / clock[0],
        "ratio": estimates[-1]["run_ratio"],  # the last estimate closes the run
    }


def runs(only: str, device: str, quick: bool) -> dict[str, dict]:
    """``run_cost`` of each model ``--only``'s patterns name as ``curvature.<model>.run`` (all where
    none); ``--quick``: one round of 4 steps."""
    patterns = [p for p in only.split(",") if p]
    chosen = [m for m in MODELS if not patterns or any(fnmatch.fnmatch(f"curvature.{m}.run", p) for p in patterns)]
    settings = {"rounds": 1, "every": 4, "window": 2} if quick else {}
    return {m: run_cost(m, device=device, **settings) for m in chosen}


def lines(model_name: str, run: dict) -> list[str]:
    """The run's estimates, one line each, then its cost."""
    out = [
        f"curvature.{model_name} estimate at step {row['step']}: {row['products']} products, "
        f"{row['estimate_s']:.2f} s = {row['plain_steps']:.1f} plain steps of {run['plain_step_s']:.3f} s"
        + (f"; the run so far {row['run_ratio']:.3f}x" if row["run_ratio"] is not None else "")
        for row in run["estimates"]
    ]
    steps = run["estimates"][-1]["step"]
    out.append(
        f"curvature.{model_name} run of {steps} steps at every: {run['every']} ({len(run['estimates'])} estimates): "
        f"{run['ratio']:.3f}x the plain copy's CPU time (its steps alone {run['after']:.3f}x)"
    )
    return out


if __name__ == "__main__":
    torch.set_num_threads(1)  # as the ratios in docs/performance.md are read: one thread, the trainer's heap
    host_heap.keep()
    for m in sys.argv[1:] or list(MODELS):
        print("\n".join(lines(m, run_cost(m))), flush=True)
