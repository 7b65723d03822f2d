"""Benchmark: gradmod's training and evaluation against the article's pipeline and the bare model.

    python scripts/bench.py              # a few minutes on 2 CPU cores; table + outputs/bench/bench.json
    python scripts/bench.py --quick      # a smoke run in seconds (numbers meaningless)
    python scripts/bench.py --device cuda --full --epochs 10   # full MNIST size (60,000 images) on a GPU

Everything runs in one process. Each repeat runs every contender once, in an order that
rotates from repeat to repeat and runs backwards every other repeat (so slow drifts of the
machine hit all of them alike, and no contender always runs right after another); the table
shows medians, and each ratio divides two medians measured in this same process, but for
the few ratios of two contenders on one model instance (``PAIRED``), formed from the
repeats' own ratios (``paired_ratio``).
Every contender starts from the same initial weights and a fresh Adam (lr 1e-3, the
article's), and trains on the same images in batches of 100.

Sections:
  epoch  one training epoch with the article's clip hook (clamp to [-0.01, 0.01]):
         article  torchvision MNIST (the bundled sample written in MNIST's file format),
                  DataLoader(batch 100, shuffle) with Resize(28) + ToTensor, loss.item() per step
         gradmod  gradmod.training.trainer.bare_epoch on device-resident data, clip rule (hook stage)
         floor    forward, backward, optimizer step on batches already in memory, no hooks
  eval   article's batch-size-1 loop (DataLoader + ToTensor, .item() per image) against
         gradmod.training.trainer.evaluate (batched, trainer.eval_batch_size)
  step   one epoch of gradmod.training.trainer.bare_epoch with: no hooks; clip as hook stage; clip as
         fused stage; torch.nn.utils.clip_grad_value_ after backward; global_norm_clip (fused);
         log read every step; log read every 50 steps; clip_logged (log, clamp, log) read every 50 steps
  ops    aten ops dispatched in one optimizer step of each contender (gradmod.testing.opcount.OpCounter),
         with the trainer's non-finite guard; deterministic, so the same on every machine
  scale  how each rule's cost grows with the model: five MLPs (4x64 ... 8x1024 Linear+ReLU blocks), batch 32,
         one thread, SGD, every rule on "*", ratios to the bare step and ops per step (scripts/bench_scale.py)
  per_sample  one DP-SGD step (clip 1, noise 1) on Opacus' MNIST example net, resnet18-GN, a small transformer and a
         784-512-512-10 MLP: plain step, Opacus (default and ghost mode, if installed), gradmod's
         per_sample stage; and each contender's peak memory, in a fresh process
         (see scripts/bench_per_sample.py)
  per_loss  one multi-task step at batch 64: the sum of the losses (plain), each loss's own backward
         (task_backwards), torchjd 0.18 (mtl_backward + jac_to_grad) and gradmod's per_loss stage with
         the same method, on a 784-512-512 trunk with 5 and 10 heads, a 2-layer transformer encoder
         with 5 and a LeNet-like conv trunk with 2; gradmod's modules mode and famo against plain;
         each contender's peak memory in a fresh process (see scripts/bench_per_loss.py)
  sharpness  one SGD step with SAM (two forward and backward passes) and with SAM every 4th step against a
         plain step, on the MNIST CNN (batch 100) and a ResNet-18 (batch 32, 32x32); SAM's extra peak
         memory over one copy of the parameters (see scripts/bench_sharpness.py)
  freeze  one AdamW step of torchvision's ResNet-18 (batch 16, 32x32) with all but fc frozen by a freeze
         rule against the same tensors frozen by hand (requires_grad=False), and with nothing frozen
         (see scripts/bench_freeze.py)
  orthogonalize  Muon's update: orthogonalize + SGD against torch.optim.Muon on the same gradients,
         on the matrices of three MLP widths (see scripts/bench_orthogonalize.py)
  sam_peers  gsam, wsam, looksam (k=5), friendly_sam and centralize+sam against pytorch-optimizer's GSAM, WSAM,
         LookSAM, FriendlySAM and SAM(use_gc=True), SGD steps on the same two models, and LookSAM against a
         plain step (see scripts/bench_sam_peers.py); asked for by name
  scores  one Adam step that keeps every example's GraNd and EL2N (the scores transform) against the plain
         step, on the MNIST CNN (batch 100) and ResNet-18-GN (batch 32, 32x32) (see scripts/bench_scores.py)
"""

from __future__ import annotations

import argparse
import copy
import fnmatch
import gc
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))  # its per_sample section beside it

import bench_freeze as freeze  # noqa: E402
import bench_orthogonalize as orthogonalize  # noqa: E402
import bench_per_loss as per_loss  # noqa: E402
import bench_per_sample as per_sample  # noqa: E402  (scripts/ is on the path when run as a script)
import bench_sam_peers as sam_peers  # noqa: E402
import bench_scale as scale  # noqa: E402
import bench_scores as scores  # noqa: E402
import bench_sharpness as sharpness  # noqa: E402

from gradmod.data import as_float, load_mnist_sample, write_mnist_raw  # noqa: E402
from gradmod.hooks import attach  # noqa: E402
from gradmod.models import MnistCNN  # noqa: E402
from gradmod.run import host_heap  # noqa: E402
from gradmod.run.setup import resolve_device  # noqa: E402
from gradmod.testing.opcount import OpCounter  # noqa: E402
from gradmod.training.nonfinite import NonFiniteGuard  # noqa: E402
from gradmod.training.speed import compile_model  # noqa: E402
from gradmod.training.trainer import bare_epoch, evaluate  # noqa: E402

BATCH = 100  # the article's batch size
CLIP = {"clip": {"params": "*", "transforms": [{"name": "clamp", "min": -0.01, "max": 0.01}]}}
LOG = {"log": {"params": "*", "transforms": ["log"]}}
NORM = {"norm": {"params": "*", "transforms": [{"name": "global_norm_clip", "max_norm": 1.0}]}}
CLIP_LOGGED = {"clip_logged": {"params": "*", "transforms": ["log", CLIP["clip"]["transforms"][0], "log"]}}
SECTIONS = (
    *("epoch", "eval", "step", "ops", "per_sample", "per_loss", "sharpness", "freeze", "orthogonalize", "scores"),
    *("scale", "sam_peers"),
)
DEFAULT_SECTIONS = SECTIONS[:-2]  # scale and sam_peers take long: asked for by name

# (name, numerator, denominator, target description, test on the value); a ratio is
# median(numerator) / median(denominator). "cuda" targets apply only on a GPU.
RATIOS = [
    ("epoch_speedup_vs_article", "epoch.article", "epoch.gradmod", "> 1 (faster than the article)", lambda r: r > 1),
    ("epoch_gradmod_over_floor", "epoch.gradmod", "epoch.floor", "<= 1.10", lambda r: r <= 1.10),
    ("eval_speedup_vs_article", "eval.article", "eval.gradmod", ">= 2", lambda r: r >= 2),
    ("eval_b100_speedup_vs_article", "eval.article", "eval.gradmod_b100", None, None),
    ("hook_overhead", "step.clip_hook", "step.none", "<= 1.05", lambda r: r <= 1.05),
    ("fused_over_none", "step.clip_fused", "step.none", None, None),
    ("clip_grad_value_over_none", "step.clip_grad_value_", "step.none", None, None),
    ("norm_fused_over_none", "step.norm_fused", "step.none", None, None),
    ("log_every_step_over_none", "step.log_every_step", "step.none", None, None),
    ("log_every_50_over_none", "step.log_every_50", "step.none", "<= 1.25", lambda r: r <= 1.25),
    ("clip_logged_over_none", "step.clip_logged", "step.none", None, None),
    ("none_over_floor", "step.none", "epoch.floor", None, None),
    ("compiled_speedup", "epoch.gradmod", "epoch.gradmod_compiled", None, None),
    (
        "per_sample_mnist_over_opacus",
        "per_sample.mnist.gradmod",
        "per_sample.mnist.opacus",
        "<= 1.0",
        lambda r: r <= 1.0,
    ),
    ("per_sample_mlp_over_opacus", "per_sample.mlp.gradmod", "per_sample.mlp.opacus", "<= 0.1", lambda r: r <= 0.1),
    (
        "per_sample_mlp_over_opacus_ghost",
        "per_sample.mlp.gradmod",
        "per_sample.mlp.opacus_ghost",
        "< 1",
        lambda r: r < 1,
    ),
    ("per_sample_mnist_over_plain", "per_sample.mnist.gradmod", "per_sample.mnist.plain", None, None),
    (
        "per_sample_resnet18gn_over_plain",
        "per_sample.resnet18gn.gradmod",
        "per_sample.resnet18gn.plain",
        "<= 2.2",
        lambda r: r <= 2.2,
    ),
    (
        "per_sample_transformer_over_plain",
        "per_sample.transformer.gradmod",
        "per_sample.transformer.plain",
        "<= 1.6",
        lambda r: r <= 1.6,
    ),
    ("per_sample_mlp_over_plain", "per_sample.mlp.gradmod", "per_sample.mlp.plain", None, None),
    (
        "per_sample_mha_over_opacus",  # nn.MultiheadAttention against Opacus' DPMultiheadAttention
        "per_sample.transformer.gradmod",
        "per_sample.transformer.opacus",
        "<= 0.8",
        lambda r: r <= 0.8,
    ),
    ("per_sample_gpt2_over_plain", "per_sample.gpt2.gradmod", "per_sample.gpt2.plain", "<= 1.8", lambda r: r <= 1.8),
    ("per_sample_gpt2_ids_over_plain", "per_sample.gpt2_ids.gradmod", "per_sample.gpt2_ids.plain", None, None),
    (
        "per_sample_gpt2_stock_over_plain",  # as returned: dropout 0.1, the key/value cache in its output
        "per_sample.gpt2_stock.gradmod",
        "per_sample.gpt2_stock.plain",
        "<= 1.8",
        lambda r: r <= 1.8,
    ),
    ("per_sample_bert_over_plain", "per_sample.bert.gradmod", "per_sample.bert.plain", "<= 1.8", lambda r: r <= 1.8),
    ("per_sample_llama_over_plain", "per_sample.llama.gradmod", "per_sample.llama.plain", "<= 1.8", lambda r: r <= 1.8),
    ("per_sample_qwen2_over_plain", "per_sample.qwen2.gradmod", "per_sample.qwen2.plain", "<= 1.8", lambda r: r <= 1.8),
    ("per_sample_t5_over_plain", "per_sample.t5.gradmod", "per_sample.t5.plain", "<= 2", lambda r: r <= 2),
    ("opacus_mlp_over_plain", "per_sample.mlp.opacus", "per_sample.mlp.plain", None, None),
    ("opacus_ghost_mlp_over_plain", "per_sample.mlp.opacus_ghost", "per_sample.mlp.plain", None, None),
]
# per_loss: a Gramian method <= 0.6x torchjd's step, and <= 3x a plain step on the MLP with 10
# heads, <= 2.5x on the transformer trunk; a loss weighting <= 1.05x plain; modules <= 1.3x plain.
GRAMIAN_OVER_PLAIN = {"mlp10": 3.0, "trans5": 2.5}
WEIGHTINGS = per_loss.WEIGHTINGS
# Ratios of two contenders on one model instance, run next to each other in every repeat: a
# few percent apart, so from the repeats' own ratios (``paired_ratio``).
PAIRED: set[str] = set()
for _m in per_loss.MODELS:
    RATIOS += [
        (
            f"per_loss_{_m}_{x}_over_torchjd",
            f"per_loss.{_m}.gradmod_{x}",
            f"per_loss.{_m}.torchjd_{x}",
            None if x in WEIGHTINGS else "<= 0.6",
            None if x in WEIGHTINGS else (lambda r: r <= 0.6),
        )
        for x in per_loss.METHODS
    ]
    RATIOS += [
        (
            f"per_loss_{_m}_modules_over_plain",
            f"per_loss.{_m}.gradmod_modules",
            f"per_loss.{_m}.plain",
            "<= 1.3",
            lambda r: r <= 1.3,
        )
    ]
    PAIRED |= {f"per_loss_{_m}_{x}_over_plain" for x in WEIGHTINGS}
    RATIOS += [  # against the plain step on the weighting's own model instance
        (
            f"per_loss_{_m}_{x}_over_plain",
            f"per_loss.{_m}.gradmod_{x}",
            f"per_loss.{_m}.plain_{x}",
            "<= 1.05",
            lambda r: r <= 1.05,
        )
        for x in WEIGHTINGS
    ]
    if _m in GRAMIAN_OVER_PLAIN:
        _t = GRAMIAN_OVER_PLAIN[_m]
        RATIOS += [
            (
                f"per_loss_{_m}_{x}_over_plain",
                f"per_loss.{_m}.gradmod_{x}",
                f"per_loss.{_m}.plain",
                f"<= {_t:g}",
                lambda r, t=_t: r <= t,
            )
            for x in per_loss.METHODS
            if x not in WEIGHTINGS
        ]
    RATIOS += [
        (f"per_loss_{_m}_torchjd_{x}_over_plain", f"per_loss.{_m}.torchjd_{x}", f"per_loss.{_m}.plain", None, None)
        for x in ("upgrad", "mgda", "pcgrad")
    ]
    RATIOS += [  # torchjd's newer methods: measured, no target
        (f"per_loss_{_m}_{x}_over_torchjd", f"per_loss.{_m}.gradmod_{x}", f"per_loss.{_m}.torchjd_{x}", None, None)
        for x in per_loss.PEERS
    ]
    # The k task gradients by k ordinary backward passes: what an exact method pays where it
    # must form them (a convolution, a Linear with more rows than features).
    RATIOS += [
        (
            f"per_loss_{_m}_task_backwards_over_plain",
            f"per_loss.{_m}.task_backwards",
            f"per_loss.{_m}.plain",
            None,
            None,
        ),
        (
            f"per_loss_{_m}_upgrad_over_task_backwards",
            f"per_loss.{_m}.gradmod_upgrad",
            f"per_loss.{_m}.task_backwards",
            None,
            None,
        ),
    ]
for _m in sharpness.MODELS:  # two passes are the floor of a SAM step: <= 2.05x plain; every 4th step: <= 1.3x
    RATIOS += [
        (
            f"sharpness_{_m}_sam_over_plain",
            f"sharpness.{_m}.sam",
            f"sharpness.{_m}.plain",
            "<= 2.05",
            lambda r: r <= 2.05,
        ),
        (
            f"sharpness_{_m}_every4_over_plain",
            f"sharpness.{_m}.sam_every4",
            f"sharpness.{_m}.plain",
            "<= 1.3",
            lambda r: r <= 1.3,
        ),
        (f"sharpness_{_m}_sam_over_two_passes", f"sharpness.{_m}.sam", f"sharpness.{_m}.two_passes", None, None),
        (f"sharpness_{_m}_two_passes_over_plain", f"sharpness.{_m}.two_passes", f"sharpness.{_m}.plain", None, None),
    ]
RATIOS += [  # a freeze rule's step is the hand-frozen one's: the frozen backward never runs
    (
        "freeze_resnet18_rule_over_by_hand",
        "freeze.resnet18.rule",
        "freeze.resnet18.plain",
        "<= 1.15",
        lambda r: r <= 1.15,
    ),
    ("freeze_resnet18_all_over_by_hand", "freeze.resnet18.all", "freeze.resnet18.plain", None, None),
]
for _m in orthogonalize.MODELS:  # the same update as torch's Muon: <= 1.05x its step
    PAIRED.add(f"orthogonalize_{_m}_over_muon")
    RATIOS.append(
        (
            f"orthogonalize_{_m}_over_muon",
            f"orthogonalize.{_m}.orthogonalize",
            f"orthogonalize.{_m}.muon",
            "<= 1.05",
            lambda r: r <= 1.05,
        )
    )
RATIOS += sam_peers.ratios()  # each rule <= 1.05x the library's step; LookSAM at k=5 <= 1.3x a plain one
RATIOS += [  # keeping each example's scores: no extra backward, <= 1.3x the plain step
    (f"scores_{m}_over_plain", f"scores.{m}.scores", f"scores.{m}.plain", "<= 1.3", lambda r: r <= 1.3)
    for m in scores.MODELS
]
UNIT_IMAGES = {"step": BATCH, "freeze_step": freeze.BATCH, "dp_step": per_sample.BATCH, "mtl_step": per_loss.BATCH}
UNIT_IMAGES |= {f"{m}_step": batch for m, (_, _, _, batch) in sharpness.MODELS.items()}  # the sharpness section
UNIT_IMAGES |= {f"scores_{m}_step": batch for m, (_, _, batch) in scores.MODELS.items()}
GPU_TARGET = ("epoch_speedup_vs_article", ">= 10 on a GPU (the article's 10 epochs, full MNIST)", lambda r: r >= 10)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
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
        default=",".join(DEFAULT_SECTIONS),
        help=f"comma-separated subset of {','.join(SECTIONS)} (default: all but scale)",
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
    args = p.parse_args(argv)
    if args.full:
        args.train_size, args.test_size = 60_000, 10_000
    if args.quick:
        args.train_size, args.test_size, args.repeats, args.warmup = 200, 50, 1, 0
    sections = [s for s in args.sections.split(",") if s]
    bad = [s for s in sections if s not in SECTIONS]
    if bad or not sections:
        p.error(f"--sections: {','.join(bad) or 'empty'} not allowed; allowed: {','.join(SECTIONS)}")
    args.sections = sections
    for key in ("repeats", "train_size", "test_size", "epochs", "eval_batch_size"):
        if getattr(args, key) < 1:
            p.error(f"--{key.replace('_', '-')} must be >= 1")
    return args


def tile(t: torch.Tensor, n: int) -> torch.Tensor:
    """``n`` items: ``t`` repeated as often as needed, then cut."""
    reps = -(-n // len(t))
    return t.repeat(reps, *([1] * (t.dim() - 1)))[:n]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Bench:
    """The data, the initial weights and every contender's set-up (untimed) and run (timed)."""

    def __init__(self, args: argparse.Namespace, device: torch.device, raw_root: str):
        self.args, self.device = args, device
        x, y, tx, ty = load_mnist_sample(seed=0, n_test=1000)
        self.cpu = (
            tile(x, args.train_size),
            tile(y, args.train_size),
            tile(tx, args.test_size),
            tile(ty, args.test_size),
        )
        self.train_x, self.train_y, self.test_x, self.test_y = (t.to(device) for t in self.cpu)
        write_mnist_raw(raw_root, self.cpu[0], self.cpu[1], train=True)
        write_mnist_raw(raw_root, self.cpu[2], self.cpu[3], train=False)
        self.raw_root = raw_root
        torch.manual_seed(1234)
        self.init = copy.deepcopy(MnistCNN().state_dict())
        self.steps = -(-args.train_size // BATCH)

    def model(self, rules=None, stage="hook"):
        model = MnistCNN().to(self.device)
        model.load_state_dict(self.init)
        hooks = attach(model, rules or {}, stage=stage)
        return model, torch.optim.Adam(model.parameters(), lr=1e-3), hooks

    # --- the article's pipeline -------------------------------------------------------

    def _article_dataset(self, train: bool):
        from torchvision import transforms
        from torchvision.datasets import MNIST

        tf = transforms.Compose([transforms.Resize(28), transforms.ToTensor()])
        return MNIST(self.raw_root, train=train, download=False, transform=tf)

    def article_epoch(self) -> Callable[[], None]:
        model, opt, _ = self.model()
        for p in model.parameters():  # the article's gradient_clipper, hooks registered by hand
            p.register_hook(lambda grad: torch.clamp(grad, -0.01, 0.01))
        loader = torch.utils.data.DataLoader(self._article_dataset(True), batch_size=BATCH, shuffle=True)
        device = self.device

        def run():
            for _ in range(self.args.epochs):
                model.train()
                running = 0.0
                for data, target in loader:
                    data, target = data.to(device), target.to(device)
                    opt.zero_grad()
                    loss = F.cross_entropy(model(data), target)
                    loss.backward()
                    opt.step()
                    running += loss.item()

        return run

    def article_eval(self) -> Callable[[], None]:
        model, _, _ = self.model()
        loader = torch.utils.data.DataLoader(self._article_dataset(False), batch_size=1, shuffle=False)
        device = self.device

        def run():
            model.eval()
            correct = 0
            with torch.no_grad():
                for data, target in loader:
                    data, target = data.to(device), target.to(device)
                    correct += (model(data).argmax(1) == target).sum().item()

        return run

    # --- gradmod ----------------------------------------------------------------------

    def gradmod_epoch(
        self, rules=CLIP, stage="hook", epochs=1, compiled=False, read_every: int | None = None
    ) -> Callable[[], None]:
        model, opt, hooks = self.model(rules, stage)
        net = compile_model(model) if compiled else model
        gen = torch.Generator().manual_seed(0)
        on_step = None
        if read_every is not None:

            def on_step(i: int) -> None:
                if i % read_every == 0:
                    hooks.read_stats()

        def run():
            for _ in range(epochs):
                bare_epoch(
                    net, opt, self.train_x, self.train_y, batch_size=BATCH, generator=gen, hooks=hooks, on_step=on_step
                )
                if read_every is not None:
                    hooks.read_stats()  # the trainer reads the rest of the window at the epoch's end

        return run

    def clip_grad_value(self) -> Callable[[], None]:
        model, opt, _ = self.model()
        params = list(model.parameters())

        class AfterBackward:  # what bare_epoch calls for backward and before the optimizer step
            needs_after_backward = True

            @staticmethod
            def backward(loss):
                loss.backward()

            @staticmethod
            def after_backward():
                torch.nn.utils.clip_grad_value_(params, 0.01)

        gen = torch.Generator().manual_seed(0)

        def run():
            bare_epoch(model, opt, self.train_x, self.train_y, batch_size=BATCH, generator=gen, hooks=AfterBackward)

        return run

    def floor(self) -> Callable[[], None]:
        model, opt, _ = self.model()
        order = torch.randperm(len(self.train_y), generator=torch.Generator().manual_seed(0)).to(self.device)
        ready = [(as_float(self.train_x[i]), self.train_y[i]) for i in order.split(BATCH)]

        def run():
            for _ in range(self.args.epochs):
                for xb, yb in ready:
                    loss = F.cross_entropy(model(xb), yb)
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()

        return run

    def gradmod_eval(self, batch_size: int) -> Callable[[], None]:
        model, _, _ = self.model()
        return lambda: evaluate(model, self.test_x, self.test_y, batch_size=batch_size)

    def contenders(self) -> dict[str, tuple[Callable[[], Callable[[], None]], int, str]]:
        """name -> (set-up returning the timed run, items per run, item unit). Each set-up binds
        its section's ``steps`` and ``batch`` as it is made (a closure would read the last section's)."""
        n, e, t = self.args.train_size, self.args.epochs, self.args.test_size
        table = {
            "epoch.article": (self.article_epoch, n * e, "image"),
            "epoch.gradmod": (lambda: self.gradmod_epoch(epochs=e), n * e, "image"),
            "epoch.floor": (self.floor, n * e, "image"),
            "eval.article": (self.article_eval, t, "image"),
            "eval.gradmod": (lambda: self.gradmod_eval(self.args.eval_batch_size), t, "image"),
            # On a CPU a batch of 1000 spills the caches (conv1's output alone is 100 MB): 100 for contrast.
            "eval.gradmod_b100": (lambda: self.gradmod_eval(100), t, "image"),
            "step.none": (lambda: self.gradmod_epoch(rules={}), self.steps, "step"),
            "step.clip_hook": (lambda: self.gradmod_epoch(rules=CLIP, stage="hook"), self.steps, "step"),
            "step.clip_fused": (lambda: self.gradmod_epoch(rules=CLIP, stage="fused"), self.steps, "step"),
            "step.clip_grad_value_": (self.clip_grad_value, self.steps, "step"),
            "step.norm_fused": (lambda: self.gradmod_epoch(rules=NORM, stage="fused"), self.steps, "step"),
            "step.log_every_step": (lambda: self.gradmod_epoch(rules=LOG, read_every=1), self.steps, "step"),
            "step.log_every_50": (lambda: self.gradmod_epoch(rules=LOG, read_every=50), self.steps, "step"),
            "step.clip_logged": (lambda: self.gradmod_epoch(rules=CLIP_LOGGED, read_every=50), self.steps, "step"),
        }
        steps = 1 if self.args.quick else per_sample.STEPS
        for name in per_sample.names(hf=not self.args.quick):  # a smoke run skips the HF models
            table[f"per_sample.{name}"] = (
                lambda name=name, steps=steps: per_sample.setup(name, steps),
                steps,
                "dp_step",
            )
        steps = 1 if self.args.quick else per_loss.STEPS
        for name in per_loss.names():
            table[f"per_loss.{name}"] = (lambda name=name, steps=steps: per_loss.setup(name, steps), steps, "mtl_step")
        steps, batch = (1, 4) if self.args.quick else (sharpness.STEPS, None)
        for name in sharpness.names():
            table[f"sharpness.{name}"] = (
                lambda name=name, steps=steps, batch=batch: sharpness.setup(name, steps, batch, self.device),
                steps,
                f"{name.split('.')[0]}_step",  # the models' batches differ
            )
        steps, batch = (1, 2) if self.args.quick else (freeze.STEPS, freeze.BATCH)
        for name in freeze.names():
            table[f"freeze.{name}"] = (
                lambda name=name, steps=steps, batch=batch: freeze.setup(name, steps, batch, str(self.device)),
                steps,
                "freeze_step",
            )
        steps = 1 if self.args.quick else orthogonalize.STEPS
        for name in orthogonalize.names():
            table[f"orthogonalize.{name}"] = (
                lambda name=name, steps=steps: orthogonalize.setup(name, steps, str(self.device)),
                steps,
                "update",
            )
        steps, batch = (1, 4) if self.args.quick else (sam_peers.STEPS, None)
        for name in sam_peers.names():
            table[f"sam_peers.{name}"] = (
                lambda name=name, steps=steps, batch=batch: sam_peers.setup(name, steps, batch, self.device),
                steps,
                f"{name.split('.')[0]}_step",
            )
        steps = 1 if self.args.quick else scores.STEPS
        for name in scores.names():
            table[f"scores.{name}"] = (
                lambda name=name, steps=steps: scores.setup(name, steps, str(self.device)),
                steps,
                f"scores_{name.split('.')[0]}_step",
            )
        if self.args.compile:
            table["epoch.gradmod_compiled"] = (lambda: self.gradmod_epoch(epochs=e, compiled=True), n * e, "image")
        only = [p for p in self.args.only.split(",") if p]
        return {
            k: v
            for k, v in table.items()
            if k.split(".")[0] in self.args.sections and (not only or any(fnmatch.fnmatch(k, p) for p in only))
        }


def measure(bench: Bench, repeats: int, warmup: int, log=print) -> dict[str, dict]:
    contenders = bench.contenders()
    runs = {name: setup() for name, (setup, _, _) in contenders.items()}
    gc.collect()
    gc.freeze()  # set-up objects out of the collector's way: collecting before each run is then cheap
    names = list(runs)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}  # the process's CPU time: steadier on a shared machine
    for r in range(-warmup, repeats):
        shift = r % len(names)
        order = names[shift:] + names[:shift]  # rotate the order each repeat
        if r % 2:  # and run it backwards every other one: each runs before its neighbour as often as after
            order.reverse()
        for name in order:
            gc.collect()
            sync(bench.device)
            t0, c0 = time.perf_counter(), time.process_time()
            runs[name]()
            sync(bench.device)
            if r >= 0:
                seconds[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
        log(f"  {'warm-up' if r < 0 else f'repeat {r + 1}/{repeats}'} done", flush=True)
    gc.unfreeze()
    results = {}
    for name, s in seconds.items():
        _, items, unit = contenders[name]
        med = statistics.median(s)
        images = items * UNIT_IMAGES.get(unit, 1)
        results[name] = {
            "section": name.split(".")[0],
            "seconds": s,
            "median_s": med,
            "min_s": min(s),
            "max_s": max(s),
            "cpu_seconds": cpu[name],
            "median_cpu_s": statistics.median(cpu[name]),
            "items": items,
            "unit": unit,
            "device": bench.device.type,
            "per_item_ms": 1000 * med / items,
            "images_per_s": images / med,
        }
    return results


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


def clock(result: dict) -> str:
    """The median a ratio divides: the per_loss section's single-threaded steps, and the
    sharpness, sam_peers, freeze, orthogonalize and scores sections' on the CPU, compare CPU time (on a shared machine
    wall time mostly measures the neighbours); the rest wall time."""
    if result["section"] == "per_loss" and result["unit"] == "mtl_step":
        return "median_cpu_s"
    on_cpu = result.get("device") == "cpu"
    return (
        "median_cpu_s"
        if result["section"] in ("sharpness", "sam_peers", "freeze", "orthogonalize", "scores") and on_cpu
        else "median_s"
    )


def paired_ratio(num: list[float], den: list[float]) -> float:
    """Two contenders on one model instance: the repeats' own ratios (the drifts they share
    cancel), the median of those run forwards times that of those run backwards, square-rooted
    (whichever runs second finds the instance in the caches: about 10% on the MLPs here)."""
    r = [a / b for a, b in zip(num, den)]
    forwards, backwards = r[0::2], r[1::2]  # measure() runs every other repeat backwards
    return math.sqrt(statistics.median(forwards) * statistics.median(backwards)) if backwards else r[0]


def ratios(results: dict[str, dict], device: torch.device) -> dict[str, dict]:
    out = {}
    for name, num, den, target, test in RATIOS:
        if num not in results or den not in results:
            continue
        key = clock(results[num])
        value = results[num][key] / results[den][key]
        if name in PAIRED:
            series = {"median_cpu_s": "cpu_seconds", "median_s": "seconds"}[key]
            value = paired_ratio(results[num][series], results[den][series])
        entry = {"value": value, "numerator": num, "denominator": den, "clock": key, "paired": name in PAIRED}
        if target is not None:
            entry.update(target=target, met=bool(test(value)))
        out[name] = entry
    if device.type == "cuda" and GPU_TARGET[0] in out:
        out[GPU_TARGET[0]].update(target=GPU_TARGET[1], met=bool(GPU_TARGET[2](out[GPU_TARGET[0]]["value"])))
    return out


def per_loss_memory(log=print) -> dict[str, dict]:
    """Each per_loss contender's peak memory (fresh process each), and gradmod's over torchjd's."""
    peaks = {}
    for name in per_loss.peak_names():
        peaks[name] = per_loss.peak_in_subprocess(name)
        log(f"  peak memory of {name}: {peaks[name] / 2**20:.1f} MiB", flush=True)
    out = {"peak_bytes": peaks, "ratios": {}}
    for name, value in peaks.items():
        model, contender = name.split(".")
        other = f"{model}.{contender.replace('gradmod_', 'torchjd_')}"
        if contender.startswith("gradmod_") and peaks.get(other, 0) > 0:
            r = value / peaks[other]
            out["ratios"][f"{model}_{contender}_peak_over_torchjd"] = {"value": r, "target": "< 1", "met": r < 1}
    return out


def peak_memory(log=print) -> dict[str, dict]:
    """Each per_sample contender's peak memory (fresh process each), and gradmod's over Opacus'."""
    peaks = {}
    for name in per_sample.names(hf=False):  # the HF models: time only
        peaks[name] = per_sample.peak_in_subprocess(name)
        log(f"  peak memory of {name}: {peaks[name] / 2**20:.1f} MiB", flush=True)
    out = {"peak_bytes": peaks, "ratios": {}}
    for model in per_sample.MODELS:
        for other in ("opacus", "opacus_ghost"):
            if peaks.get(f"{model}.{other}", 0) > 0:
                value = peaks[f"{model}.gradmod"] / peaks[f"{model}.{other}"]
                out["ratios"][f"{model}_peak_over_{other}"] = {"value": value, "target": "< 1", "met": value < 1}
    return out


def machine(device: torch.device) -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torchvision

    info = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "host_heap": "keep" if host_heap.kept else "release",
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": str(device),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def table(results: dict[str, dict], rat: dict[str, dict]) -> str:
    base = {"epoch": "epoch.floor", "eval": "eval.gradmod", "step": "step.none"}
    lines = [
        f"{'contender':<28} {'median s':>9} {'min s':>8} {'max s':>8} {'cpu s':>8} {'per item':>16} {'images/s':>9} "
        f"{'x base':>7}"
    ]
    for name, r in results.items():
        b = results.get(base.get(r["section"]) or f"{name.rpartition('.')[0]}.plain")
        key = clock(r)
        x = f"{r[key] / b[key]:.3f}" if b else "-"
        lines.append(
            f"{name:<28} {r['median_s']:>9.3f} {r['min_s']:>8.3f} {r['max_s']:>8.3f} {r['median_cpu_s']:>8.3f} "
            f"{r['per_item_ms']:>8.3f} ms/{r['unit']:<7} {r['images_per_s']:>9.0f} {x:>7}"
        )
    lines.append("")
    lines.append(f"{'ratio':<34} {'value':>7}  target")
    for name, r in rat.items():
        verdict = "" if "target" not in r else f"{r['target']}: {'met' if r['met'] else 'NOT met'}"
        lines.append(f"{name:<34} {r['value']:>7.3f}  {verdict}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
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
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="gradmod-bench-") as raw_root:
        bench = Bench(args, device, raw_root)
        print(
            f"bench: {args.train_size} train / {args.test_size} test images on {device}, "
            f"{args.repeats} repeats (+{args.warmup} warm-up), sections {','.join(args.sections)}",
            flush=True,
        )
        ops = op_counts(bench) if "ops" in args.sections else {}
        timed = any(s not in ("ops", "scale") for s in args.sections)
        # Peak memory first (fresh processes, before this one grows): a failure shows early.
        whole = not args.quick and not args.only  # a smoke run, or some contenders: no peak memory
        memory = peak_memory() if "per_sample" in args.sections and whole and device.type == "cpu" else {}
        if "per_loss" in args.sections and whole and device.type == "cpu":
            loss_memory = per_loss_memory()
            memory = {
                "peak_bytes": {**memory.get("peak_bytes", {}), **loss_memory["peak_bytes"]},
                "ratios": {**memory.get("ratios", {}), **loss_memory["ratios"]},
            }
        if "sharpness" in args.sections and whole:
            sharp_memory = sharpness.memory(resident=device.type == "cpu", device=str(device))
            memory = {
                "peak_bytes": {**memory.get("peak_bytes", {}), **sharp_memory["peak_bytes"]},
                "ratios": {**memory.get("ratios", {}), **sharp_memory["ratios"]},
            }
        results = measure(bench, args.repeats, args.warmup) if timed else {}
        scaled = (
            scale.measure(*((2, 2) if args.quick else (args.scale_rounds, scale.RUN_STEPS)))
            if "scale" in args.sections
            else {}
        )
    rat = ratios(results, device)
    report = {
        "machine": {
            **machine(device),
            "load_average_before": list(load_before),
            "load_average_after": list(os.getloadavg()),
        },
        "settings": {k: v for k, v in vars(args).items() if k != "json"}
        | {"batch_size": BATCH, "steps_per_epoch": bench.steps},
        "command": " ".join(["python", "scripts/bench.py", *(sys.argv[1:] if argv is None else argv)]),
        "results": results,
        "ratios": rat,
        "ops": ops,
        "memory": memory,
        "scale": scaled,
    }
    print(table(results, rat))
    if ops:
        print(ops_table(ops))
    if scaled:
        print(scale.table(scaled))
    for name, r in memory.get("ratios", {}).items():
        print(f"{name:<34} {r['value']:>7.3f}  {r['target']}: {'met' if r['met'] else 'NOT met'}")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return report


if __name__ == "__main__":
    main()
