"""The MNIST sections, ``epoch``, ``eval`` and ``step``: gradmod's training and evaluation
against the article's pipeline and the bare model, on the bundled MNIST sample.

Every contender starts from the same initial weights and a fresh Adam (lr 1e-3, the
article's), and trains on the same images in batches of 100.

  epoch  one training epoch with the article's clip hook (clamp to [-0.01, 0.01]):
         article  torchvision MNIST (the bundled sample written in MNIST's file format),
                  DataLoader(batch 100, shuffle) with Resize(28) + ToTensor, loss.item() per step
         gradmod  gradmod.testing.epochs.bare_epoch on device-resident data, clip rule (hook stage)
         floor    forward, backward, optimizer step on batches already in memory, no hooks
  eval   article's batch-size-1 loop (DataLoader + ToTensor, .item() per image) against
         gradmod.training.trainer.evaluate (batched, trainer.eval_batch_size)
  step   one epoch of bare_epoch with: no hooks; clip as hook stage; clip as fused stage;
         torch.nn.utils.clip_grad_value_ after backward; global_norm_clip (fused); log read
         every step; log read every 50 steps; clip_logged (log, clamp, log) read every 50 steps
"""

from __future__ import annotations

import argparse
import copy
from typing import Callable

import torch
import torch.nn.functional as F

from benchmarks.timing import Contenders
from gradmod.data import as_float, load_mnist_sample
from gradmod.hooks import attach
from gradmod.models import MnistCNN
from gradmod.testing.epochs import bare_epoch
from gradmod.testing.mnist_files import write_mnist_raw
from gradmod.training.speed import compile_model
from gradmod.training.trainer import evaluate

BATCH = 100  # the article's batch size
CLIP = {"clip": {"params": "*", "transforms": [{"name": "clamp", "min": -0.01, "max": 0.01}]}}
LOG = {"log": {"params": "*", "transforms": ["log"]}}
NORM = {"norm": {"params": "*", "transforms": [{"name": "global_norm_clip", "max_norm": 1.0}]}}
CLIP_LOGGED = {"clip_logged": {"params": "*", "transforms": ["log", CLIP["clip"]["transforms"][0], "log"]}}
SECTIONS = ("epoch", "eval", "step")


def tile(t: torch.Tensor, n: int) -> torch.Tensor:
    """``n`` items: ``t`` repeated as often as needed, then cut."""
    reps = -(-n // len(t))
    return t.repeat(reps, *([1] * (t.dim() - 1)))[:n]


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


def contenders(bench: Bench) -> Contenders:
    """The epoch, eval and step sections: name -> (set-up, items per run, item unit)."""
    args = bench.args
    n, e, t, steps = args.train_size, args.epochs, args.test_size, bench.steps
    return {
        "epoch.article": (bench.article_epoch, n * e, "image"),
        "epoch.gradmod": (lambda: bench.gradmod_epoch(epochs=e), n * e, "image"),
        "epoch.floor": (bench.floor, n * e, "image"),
        "eval.article": (bench.article_eval, t, "image"),
        "eval.gradmod": (lambda: bench.gradmod_eval(args.eval_batch_size), t, "image"),
        # On a CPU a batch of 1000 spills the caches (conv1's output alone is 100 MB): 100 for contrast.
        "eval.gradmod_b100": (lambda: bench.gradmod_eval(100), t, "image"),
        "step.none": (lambda: bench.gradmod_epoch(rules={}), steps, "step"),
        "step.clip_hook": (lambda: bench.gradmod_epoch(rules=CLIP, stage="hook"), steps, "step"),
        "step.clip_fused": (lambda: bench.gradmod_epoch(rules=CLIP, stage="fused"), steps, "step"),
        "step.clip_grad_value_": (bench.clip_grad_value, steps, "step"),
        "step.norm_fused": (lambda: bench.gradmod_epoch(rules=NORM, stage="fused"), steps, "step"),
        "step.log_every_step": (lambda: bench.gradmod_epoch(rules=LOG, read_every=1), steps, "step"),
        "step.log_every_50": (lambda: bench.gradmod_epoch(rules=LOG, read_every=50), steps, "step"),
        "step.clip_logged": (lambda: bench.gradmod_epoch(rules=CLIP_LOGGED, read_every=50), steps, "step"),
    }


def compiled(bench: Bench) -> Contenders:
    """``--compile``: gradmod's epoch through torch.compile (last in the table)."""
    if not bench.args.compile:
        return {}
    n, e = bench.args.train_size, bench.args.epochs
    return {"epoch.gradmod_compiled": (lambda: bench.gradmod_epoch(epochs=e, compiled=True), n * e, "image")}
