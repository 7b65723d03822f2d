"""What an optimizer step costs with optimizer=muon against optimizer=adamw, in one process,
on one thread: the aten ops each step dispatches (deterministic) and the median time of the
optimizer step alone (gradients held fixed), turn by turn, as a ratio to AdamW's.

    python -m benchmarks.sections.optim             # tiny_gpt and mnist_cnn, 50 steps each; then the peers
    python -m benchmarks.sections.optim --steps 200
    python -m benchmarks.sections.optim --only peers  # lars, lamb, layer_decay against their peers' steps

The peers: ``optimizer=lars`` and ``optimizer=lamb`` against pytorch-optimizer's ``LARS`` and
``Lamb`` (the settings the tests find equal), ``layer_decay`` against timm's
``create_optimizer_v2(layer_decay=0.75)``, each at two model sizes (ResNet-18 and ResNet-50; ViT-tiny
and ViT-small), the same gradients restored before each step, turn by turn.

Muon's step runs ``ns_steps`` Newton-Schulz iterations per matrix in bfloat16 (about
``ns_steps * (4 m^2 n + 2 m^3)`` flops for an m x n matrix, m <= n), where AdamW does a few
element-wise passes; on a CPU without bfloat16 matrix units that is most of the step.
"""

from __future__ import annotations

import argparse
import copy
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


def peer_ratio(make, mine_spec, theirs, steps: int) -> float:
    """Median step time of ``gradmod.optimizer(model, mine_spec)`` over ``theirs(model)``'s, each on
    its own copy of the model, turn by turn, the gradients restored (untimed) before every step."""
    torch.manual_seed(0)
    model = make()
    grads = {n: torch.randn_like(p) for n, p in model.named_parameters()}
    other = copy.deepcopy(model)
    pairs = [(model, gradmod.optimizer(model, mine_spec)), (other, theirs(other))]
    times: list[list[float]] = [[], []]
    for step in range(steps + 2):  # two warm-up steps: the state exists
        for i, (net, opt) in enumerate(pairs):
            for n, p in net.named_parameters():
                p.grad = grads[n].clone()
            t0 = time.perf_counter()
            opt.step()
            if step >= 2:
                times[i].append(time.perf_counter() - t0)
    return statistics.median(times[0]) / statistics.median(times[1])


def peers(steps: int) -> dict[str, float]:
    import pytorch_optimizer as po
    import timm
    import timm.optim
    import torchvision

    from gradmod.run.optimizer_presets import LambConfig, LarsConfig

    lars, lamb = dataclasses.asdict(LarsConfig()), dataclasses.asdict(LambConfig())
    tr = lars["groups"][0]["trust_ratio"]

    def po_lars(m):
        return po.LARS(
            m.parameters(), lr=lars["lr"], momentum=0.9, weight_decay=tr["weight_decay"], trust_coefficient=tr["eta"]
        )

    def po_lamb(m):
        groups = [{"params": [p for p in m.parameters() if p.ndim > 1]}]
        groups.append({"params": [p for p in m.parameters() if p.ndim <= 1], "weight_decay": 0.0, "adam": True})
        return po.Lamb(groups, lr=lamb["lr"], weight_decay=lamb["weight_decay"], eps=lamb["eps"], adam_debias=True)

    layer = {"_target_": "torch.optim.AdamW", "lr": 1e-3, "weight_decay": 0.05, "layer_decay": 0.75}
    layer["no_decay"] = ["@vectors", "@no_weight_decay"]

    def timm_layer(m):
        return timm.optim.create_optimizer_v2(m, "adamw", lr=1e-3, weight_decay=0.05, layer_decay=0.75)

    out = {}
    for size in ("resnet18", "resnet50"):
        make = getattr(torchvision.models, size)
        out[f"lars_{size}"] = peer_ratio(make, lars, po_lars, steps)
        out[f"lamb_{size}"] = peer_ratio(make, lamb, po_lamb, steps)
    for size in ("vit_tiny_patch16_224", "vit_small_patch16_224"):
        out[f"layer_decay_{size}"] = peer_ratio(lambda s=size: timm.create_model(s), layer, timm_layer, steps)
    return out


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--only", choices=("muon", "peers", "all"), default="all")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    results = {}
    if args.only in ("peers", "all"):
        results["peers"] = peers(args.steps)
        for name, ratio in results["peers"].items():
            print(f"{name:34s} step time gradmod / peer: {ratio:.3f}x")
    if args.only == "peers":
        return results
    for model_name in MODELS:
        r = results[model_name] = measure(model_name, args.steps)
        print(
            f"{model_name:10s} ops per step: adamw {r['adamw_ops']:.0f}, muon {r['muon_ops']:.0f}; "
            f"step time muon / adamw: {r['muon_over_adamw']:.1f}x"
        )
    return results


if __name__ == "__main__":
    main()
