"""The ``ops`` section: the aten ops dispatched in one optimizer step of each contender
(``gradmod.testing.opcount.OpCounter``), with the trainer's non-finite guard;
deterministic, so the same on every machine."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from benchmarks.mnist import BATCH, CLIP, CLIP_LOGGED, LOG, NORM, Bench
from gradmod.data import as_float
from gradmod.testing.epochs import bare_epoch
from gradmod.testing.opcount import OpCounter
from gradmod.training.nonfinite import NonFiniteGuard

OP_CONTENDERS = {  # name -> (rules, stage, non-finite guard); "bare" is the base of the budgets
    "bare": ({}, "hook", False),
    "none": ({}, "hook", True),
    "clip_hook": (CLIP, "hook", True),
    "clip_fused": (CLIP, "fused", True),
    "log": (LOG, "hook", True),
    "clip_logged": (CLIP_LOGGED, "hook", True),
    "norm_fused": (NORM, "fused", True),
}


def op_counts(bench: Bench) -> dict[str, dict]:
    """Aten ops of one optimizer step (batch 100) per contender, after one warm-up step.
    ``floor``: forward, backward and Adam's step in a plain loop; ``bare``: bare_epoch
    without hooks or non-finite guard; the others run with the trainer's guard (warn).
    ``over_bare``: ops beyond ``bare``, the measure the op budgets use."""
    xb, yb = bench.train_x[:BATCH], bench.train_y[:BATCH]
    model, opt, _ = bench.model()
    floor = []
    for _ in range(2):
        with OpCounter() as ops:
            loss = F.cross_entropy(model(as_float(xb)), yb)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        floor.append(ops.count)
    out = {"floor": {"ops": floor[-1]}}
    for name, (rules, stage, guard) in OP_CONTENDERS.items():
        model, opt, hooks = bench.model(rules, stage)
        kw = dict(
            batch_size=BATCH,
            generator=torch.Generator().manual_seed(0),
            hooks=hooks,
            guard=NonFiniteGuard(model, hooks, "warn") if guard else None,
        )
        bare_epoch(model, opt, xb, yb, **kw)
        with OpCounter() as ops:
            bare_epoch(model, opt, xb, yb, **kw)
        hooks.remove()
        tensors = len(list(model.parameters()))
        bare = out.get("bare", {"ops": ops.count})["ops"]
        out[name] = {
            "ops": ops.count,
            "over_bare": ops.count - bare,
            "tensors": tensors,
            "over_bare_per_tensor": (ops.count - bare) / tensors,
        }
    return out


def ops_table(ops: dict[str, dict]) -> str:
    lines = [f"{'ops per step':<16} {'ops':>5} {'over bare':>10} {'per tensor':>11}"]
    for name, r in ops.items():
        over = f"{r['over_bare']}" if "tensors" in r else "-"
        per = f"{r['over_bare_per_tensor']:.2f}" if "tensors" in r else "-"
        lines.append(f"{name:<16} {r['ops']:>5} {over:>10} {per:>11}")
    return "\n".join(lines)
