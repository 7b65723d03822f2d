"""Benchmark: gradmod's training and evaluation against the article's pipeline and the bare model.

    python -m benchmarks                  # a few minutes on 2 CPU cores; table + outputs/bench/bench.json
    python -m benchmarks --quick          # a smoke run in seconds (numbers meaningless)
    python -m benchmarks freeze scores    # some sections (or --sections freeze,scores)
    python -m benchmarks --device cuda --full --epochs 10   # full MNIST size (60,000 images) on a GPU

Everything runs in one process (``benchmarks.timing``): each repeat runs every contender
once, in an order that rotates from repeat to repeat; each ratio divides two medians
measured in this same process (``benchmarks.ratios``).

Sections (the default: all but scale, sam_peers, curvature and influence):
  epoch, eval, step  the MNIST CNN: the article's pipeline, gradmod's epoch and evaluation, the
         bare model, and each rule's step (benchmarks/mnist.py)
  ops    aten ops dispatched in one optimizer step of each contender (benchmarks/ops.py)
  scale  how each rule's cost grows with the model: five MLPs (4x64 ... 8x1024 Linear+ReLU blocks), batch 32,
         one thread, SGD, every rule on "*", ratios to the bare step and ops per step (benchmarks/sections/scale.py)
  per_sample  one DP-SGD step (clip 1, noise 1) on Opacus' MNIST example net, resnet18-GN, a small transformer and a
         784-512-512-10 MLP: plain step, Opacus (default and ghost mode, if installed), gradmod's
         per_sample stage; and each contender's peak memory, in a fresh process
         (see benchmarks/sections/per_sample.py)
  per_loss  one multi-task step at batch 64: the sum of the losses (plain), each loss's own backward
         (task_backwards), torchjd 0.18 (mtl_backward + jac_to_grad) and gradmod's per_loss stage with
         the same method, on a 784-512-512 trunk with 5 and 10 heads, a 2-layer transformer encoder
         with 5 and a LeNet-like conv trunk with 2; gradmod's modules mode and famo against plain;
         each contender's peak memory in a fresh process (see benchmarks/sections/per_loss.py)
  sharpness  one SGD step with SAM (two forward and backward passes) and with SAM every 4th step against a
         plain step, on the MNIST CNN (batch 100) and a ResNet-18 (batch 32, 32x32); SAM's extra peak
         memory over one copy of the parameters (see benchmarks/sections/sharpness.py)
  freeze  one AdamW step of torchvision's ResNet-18 (batch 16, 32x32) with all but fc frozen by a freeze
         rule against the same tensors frozen by hand (requires_grad=False), and with nothing frozen
         (see benchmarks/sections/freeze.py)
  orthogonalize  Muon's update: orthogonalize + SGD against torch.optim.Muon on the same gradients,
         on the matrices of three MLP widths (see benchmarks/sections/orthogonalize.py)
  sam_peers  gsam, wsam, looksam (k=5), friendly_sam and centralize+sam against pytorch-optimizer's GSAM, WSAM,
         LookSAM, FriendlySAM and SAM(use_gc=True), SGD steps on the same two models, and LookSAM against a
         plain step (see benchmarks/sections/sam_peers.py); asked for by name
  scores  one Adam step that keeps every example's GraNd and EL2N (the scores transform) against the plain
         step, on the MNIST CNN (batch 100) and ResNet-18-GN (batch 32, 32x32) (see benchmarks/sections/scores.py)
  penalty  one Adam step with grad_penalty and input_grad_penalty against the same penalty written by hand and
         against a plain step, and DP-SGD with input_grad_penalty against torch.func's per-example step, on a
         784-1024-1024-10 MLP (batch 64) and the MNIST CNN (batch 100) (see benchmarks/sections/penalty.py)
  curvature  100 SGD steps with one curvature estimate (the shipped rule at every: 100) against 100 plain ones,
         and a whole run of 2,000 steps at every: 100 beside a plain copy (its target), on the MNIST CNN
         and ResNet-18 (see benchmarks/sections/curvature.py); asked for by name
  influence  TracIn influence of 1,000 training examples on 8 test examples over 2 checkpoints of the MNIST
         CNN: gradmod exact and projected against Captum's TracInCP (sample_wise_grads_per_batch)
         (see benchmarks/sections/influence.py); asked for by name
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks import contenders, memory, ops, report, timing
from benchmarks.mnist import BATCH, Bench
from benchmarks.ratios import ratios, run_ratios
from benchmarks.sections import curvature, scale
from gradmod.run import host_heap
from gradmod.run.setup import resolve_device

SECTIONS = (
    *("epoch", "eval", "step", "ops", "per_sample", "per_loss", "sharpness", "freeze", "orthogonalize", "scores"),
    "penalty",
    *("scale", "sam_peers", "curvature", "influence"),
)
DEFAULT_SECTIONS = SECTIONS[:-4]  # scale, sam_peers, curvature and influence take long: asked for by name


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "positional_sections",
        nargs="*",
        metavar="SECTION",
        help="sections to run, as --sections names them (each may be a comma-separated list too)",
    )
    p.add_argument("--device", default="cpu", help="cpu | cuda | auto (default: cpu)")
    p.add_argument("--repeats", type=int, default=9, help="timed runs of every contender (default 9)")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs of every contender first (default 1)")
    p.add_argument(
        "--train-size",
        type=int,
        default=4000,
        help="training images: the sample's 4,000-image train split, tiled or cut (default 4000)",
    )
    p.add_argument("--test-size", type=int, default=1000, help="test images, the 1,000-image split tiled or cut")
    p.add_argument("--full", action="store_true", help="MNIST's size: --train-size 60000 --test-size 10000")
    p.add_argument("--epochs", type=int, default=1, help="epochs per timed run in the epoch section (default 1)")
    p.add_argument(
        "--eval-batch-size",
        type=int,
        default=1000,
        help="gradmod's evaluation batch (default 1000, trainer.eval_batch_size)",
    )
    p.add_argument(
        "--sections",
        default=None,
        help=f"comma-separated subset of {','.join(SECTIONS)} (default: all but scale, sam_peers, curvature and influence)",
    )
    p.add_argument(
        "--compile", action="store_true", help="also time gradmod's epoch with torch.compile (slow to compile)"
    )
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's choice)")
    p.add_argument(
        "--host-heap",
        choices=host_heap.HOST_HEAPS,
        default="release",
        help="keep: glibc keeps freed memory in its heap, as the trainer's trainer.host_heap=keep does "
        "(default release: the C library's defaults)",
    )
    p.add_argument("--json", default="outputs/bench/bench.json", help="where to write the results")
    p.add_argument("--quick", action="store_true", help="a tiny smoke run: 200/50 images, 1 repeat, no warm-up")
    p.add_argument(
        "--only",
        default="",
        help="comma-separated patterns of the contenders to time (fnmatch: 'per_loss.*_pcd'); "
        "their sections' peak memory is left out (default: every contender of the sections)",
    )
    p.add_argument(
        "--scale-rounds", type=int, default=15, help="timed runs per contender in the scale section (default 15)"
    )
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The options; ``sections``: those named positionally and by ``--sections``, in that
    order (the default sections where neither names any)."""
    p = parser()
    args = p.parse_intermixed_args(argv)
    if args.full:
        args.train_size, args.test_size = 60_000, 10_000
    if args.quick:
        args.train_size, args.test_size, args.repeats, args.warmup = 200, 50, 1, 0
    named = [*args.positional_sections, *([args.sections] if args.sections is not None else [])]
    del args.positional_sections  # bench.json's settings: the same keys as before
    sections = list(dict.fromkeys(s for part in named for s in part.split(",") if s))
    if not named:
        sections = list(DEFAULT_SECTIONS)
    bad = [s for s in sections if s not in SECTIONS]
    if bad or not sections:
        p.error(f"--sections: {','.join(bad) or 'empty'} not allowed; allowed: {','.join(SECTIONS)}")
    args.sections = sections
    for key in ("repeats", "train_size", "test_size", "epochs", "eval_batch_size"):
        if getattr(args, key) < 1:
            p.error(f"--{key.replace('_', '-')} must be >= 1")
    return args


def run(args: argparse.Namespace, device: torch.device, command: str) -> dict:
    """Every section asked for, in one process: the report ``main`` prints and writes."""
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="gradmod-bench-") as raw_root:
        bench = Bench(args, device, raw_root)
        print(
            f"bench: {args.train_size} train / {args.test_size} test images on {device}, "
            f"{args.repeats} repeats (+{args.warmup} warm-up), sections {','.join(args.sections)}",
            flush=True,
        )
        counted = ops.op_counts(bench) if "ops" in args.sections else {}
        timed = any(s not in ("ops", "scale") for s in args.sections)
        # Peak memory first (fresh processes, before this one grows): a failure shows early.
        peaks = memory.measure(args.sections, device, whole=not args.quick and not args.only)
        table = contenders.contenders(bench) if timed else {}
        curvature.PRODUCTS.clear()
        results = timing.measure(table, device, args.repeats, args.warmup, contenders.UNIT_IMAGES) if timed else {}
        rounds = (2, 2) if args.quick else (args.scale_rounds, scale.RUN_STEPS)
        scaled = scale.measure(*rounds) if "scale" in args.sections else {}
        runs = curvature.runs(args.only, str(device), args.quick) if "curvature" in args.sections else {}
    return {
        "machine": {
            **report.machine(device),
            "load_average_before": list(load_before),
            "load_average_after": list(os.getloadavg()),
        },
        "settings": {k: v for k, v in vars(args).items() if k != "json"}
        | {"batch_size": BATCH, "steps_per_epoch": bench.steps},
        "command": command,
        "results": results,
        "ratios": ratios(results, device) | run_ratios(runs),
        "ops": counted,
        "memory": peaks,
        "scale": scaled,
        "curvature_products": dict(curvature.PRODUCTS),
        "curvature_runs": runs,
    }


def main(argv: list[str] | None = None) -> dict:
    """``python -m benchmarks [SECTION ...] [options]``: run, print the table, write the JSON report."""
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.host_heap == "keep":
        host_heap.keep()
    try:
        device = resolve_device(args.device)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    out = run(args, device, " ".join(["python", "-m", "benchmarks", *(sys.argv[1:] if argv is None else argv)]))
    print(report.table(out["results"], out["ratios"]))
    if out["ops"]:
        print(ops.ops_table(out["ops"]))
    if out["scale"]:
        print(scale.table(out["scale"]))
    for line in report.memory_lines(out["memory"]):
        print(line)
    for model, counts in out["curvature_products"].items():
        print(f"curvature.{model}: products per estimate, in the order they ran (warm-up runs first): {counts}")
    for model, measured in out["curvature_runs"].items():
        print("\n".join(curvature.lines(model, measured)))
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path}")
    return out
