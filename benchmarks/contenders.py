"""Every timed section's contenders, as ``benchmarks.timing.measure`` times them: name ->
(set-up, items per run, item unit), filtered by ``--sections`` and ``--only``.

Each set-up is bound to its own section's step count and batch when the table is built
(``functools.partial``), and each contender's items per run are those steps: a set-up that
read them when called would see the last section's values instead.
"""

from __future__ import annotations

import fnmatch
from functools import partial
from typing import Callable

from benchmarks import mnist
from benchmarks.sections import (
    curvature,
    freeze,
    influence,
    orthogonalize,
    penalty,
    per_loss,
    per_sample,
    sam_peers,
    scores,
    sharpness,
)
from benchmarks.timing import Contenders

# The images in one item of a unit: a step of the MNIST sections holds a batch of 100.
UNIT_IMAGES = {
    "step": mnist.BATCH,
    "freeze_step": freeze.BATCH,
    "dp_step": per_sample.BATCH,
    "mtl_step": per_loss.BATCH,
}
UNIT_IMAGES |= {f"{m}_step": batch for m, (_, _, _, batch) in sharpness.MODELS.items()}  # the sharpness section
UNIT_IMAGES |= {f"scores_{m}_step": batch for m, (_, _, batch) in scores.MODELS.items()}
UNIT_IMAGES |= {f"penalty_{m}_step": batch for m, (_, batch) in penalty.MODELS.items()}


def section(name: str, names: list[str], setup: Callable, steps: int, unit: str | Callable[[str], str]) -> Contenders:
    """``name.<contender>`` -> (``setup(contender)``, ``steps``, its unit) for each contender:
    ``setup`` already holds the section's steps (and batch, device) as arguments."""
    return {f"{name}.{n}": (partial(setup, n), steps, unit if isinstance(unit, str) else unit(n)) for n in names}


def _model_step(name: str) -> str:
    return f"{name.split('.')[0]}_step"  # the models' batches differ


def sections(bench: mnist.Bench) -> Contenders:
    """The contenders of every timed section, in the table's order (the MNIST sections first)."""
    quick, device = bench.args.quick, bench.device
    table = mnist.contenders(bench)
    steps = 1 if quick else per_sample.STEPS
    run = partial(per_sample.setup, steps=steps)
    table |= section("per_sample", per_sample.names(hf=not quick), run, steps, "dp_step")  # a smoke run: no HF models
    steps = 1 if quick else per_loss.STEPS
    table |= section("per_loss", per_loss.names(), partial(per_loss.setup, steps=steps), steps, "mtl_step")
    steps, batch = (1, 4) if quick else (sharpness.STEPS, None)
    run = partial(sharpness.setup, steps=steps, batch=batch, device=device)
    table |= section("sharpness", sharpness.names(), run, steps, _model_step)
    steps, batch = (1, 2) if quick else (freeze.STEPS, freeze.BATCH)
    run = partial(freeze.setup, steps=steps, batch=batch, device=str(device))
    table |= section("freeze", freeze.names(), run, steps, "freeze_step")
    steps = 1 if quick else orthogonalize.STEPS
    run = partial(orthogonalize.setup, steps=steps, device=str(device))
    table |= section("orthogonalize", orthogonalize.names(), run, steps, "update")
    steps, batch = (1, 4) if quick else (sam_peers.STEPS, None)
    run = partial(sam_peers.setup, steps=steps, batch=batch, device=device)
    table |= section("sam_peers", sam_peers.names(), run, steps, _model_step)
    steps = 1 if quick else scores.STEPS
    run = partial(scores.setup, steps=steps, device=str(device))
    table |= section("scores", scores.names(), run, steps, lambda n: f"scores_{_model_step(n)}")
    steps = 1 if quick else penalty.STEPS
    run = partial(penalty.setup, steps=steps, device=str(device))
    table |= section("penalty", penalty.names(), run, steps, lambda n: f"penalty_{_model_step(n)}")
    steps, batch = (2, 4) if quick else (curvature.EVERY, None)
    run = partial(curvature.setup, steps=steps, device=str(device), batch=batch)
    table |= section("curvature", curvature.names(), run, steps, _model_step)
    run = partial(influence.setup, steps=1, batch=50 if quick else None, device=str(device))
    table |= section("influence", influence.names(), run, 1, "influence_run")
    return table | mnist.compiled(bench)


def contenders(bench: mnist.Bench) -> Contenders:
    """The contenders of the sections asked for, those ``--only``'s patterns name (all where none)."""
    only = [p for p in bench.args.only.split(",") if p]
    return {
        k: v
        for k, v in sections(bench).items()
        if k.split(".")[0] in bench.args.sections and (not only or any(fnmatch.fnmatch(k, p) for p in only))
    }
