"""What an optimizer step costs with optimizer=muon against optimizer=adamw, in one process,
on one thread: the aten ops each step dispatches (deterministic) and the median time of the
optimizer step alone (gradients held fixed), turn by turn, as a ratio to AdamW's.

    python -m benchmarks.sections.optim             # tiny_gpt and mnist_cnn, 50 steps each
    python -m benchmarks.sections.optim --steps 200

Muon's step runs ``ns_steps`` Newton-Schulz iterations per matrix in bfloat16 (about
``ns_steps * (4 m^2 n + 2 m^3)`` flops for an m x n matrix, m <= n), where AdamW does a few
element-wise passes; on a CPU without bfloat16 matrix units that is most of the step.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

import gradmod
from gradmod.models import build_model
from gradmod.run.config import AdamWConfig, MuonConfig
from gradmod.testing.opcount import OpCounter

ADAMW = dataclasses.asdict(AdamWConfig())  # optimizer=adamw, as gradmod.optimizer's spec
MUON = dataclasses.asdict(MuonConfig())  # optimizer=muon: the recipe's one source
MODELS = {"tiny_gpt": {"num_classes": 65}, "mnist_cnn": {}}


def optimizer_with_grads(model_name: str, spec: dict) -> torch.optim.Optimizer:
    torch.manual_seed(0)
    model = build_model(model_name, **MODELS[model_name])
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt = gradmod.optimizer(model, spec)
    opt.step()  # the state exists: every counted step is alike
    return opt


def measure(model_name: str, steps: int) -> dict[str, float]:
    opts = {"adamw": optimizer_with_grads(model_name, ADAMW), "muon": optimizer_with_grads(model_name, MUON)}
    out: dict[str, float] = {}
    for name, opt in opts.items():
        with OpCounter() as ops:
            opt.step()
        out[f"{name}_ops"] = ops.count
    times: dict[str, list[float]] = {name: [] for name in opts}
    for _ in range(steps):  # turn by turn: a slow spell of the machine falls on both
        for name, opt in opts.items():
            t0 = time.perf_counter()
            opt.step()
            times[name].append(time.perf_counter() - t0)
    out["muon_over_adamw"] = statistics.median(times["muon"]) / statistics.median(times["adamw"])
    return out


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    results = {}
    for model_name in MODELS:
        r = results[model_name] = measure(model_name, args.steps)
        print(
            f"{model_name:10s} ops per step: adamw {r['adamw_ops']:.0f}, muon {r['muon_ops']:.0f}; "
            f"step time muon / adamw: {r['muon_over_adamw']:.1f}x"
        )
    return results


if __name__ == "__main__":
    main()
