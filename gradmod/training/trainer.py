"""The Trainer: the epoch loop, and the named moments its callbacks see.

``fit`` reads as its steps: for each epoch, train (each optimizer step: forward and
backward over the step's micro-batches, ``on_after_backward``, the fused hook stage,
``on_before_optimizer_step``, the step, a read of the ``log`` statistics at log points
(``on_log``), ``on_step_end``), evaluate, ``on_epoch_end``; at the end ``on_fit_end``.
What happens at a moment (checkpoints, run files, the non-finite policy, the sync check)
lives in callbacks (``gradmod.training.callbacks``), each with its own ``state_dict``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm.auto import tqdm

from gradmod.data import Data
from gradmod.hooks.losses import total as total_loss
from gradmod.training.after_step import AfterStepLosses
from gradmod.training.callbacks import check_order
from gradmod.training.distributed.strategy import Dist, no_sync
from gradmod.training.loader import batches, batches_per_epoch, poisson_batches, poisson_steps
from gradmod.training.loop_hooks import Hooks, StagedHooks
from gradmod.training.precision import Precision
from gradmod.training.stage_sync import StageSync
from gradmod.training.tasks import CROSS_ENTROPY, Tasks, results, scaled
from gradmod.training.tasks import evaluate as evaluate_tasks


@dataclass(frozen=True)
class TrainerSettings:
    """The loop's scalar knobs. ``accumulate=k``: k micro-batches of ``batch_size`` per
    optimizer step, each loss divided by the number in its step (under DDP only the last
    one all-reduces); ``log_every``: optimizer steps between reads of the ``log``
    statistics; ``loader_workers``: DataLoader workers for host-memory data (None: the
    data is on the device and batches are indexed there). With a per_sample stage the loss
    is not divided and DDP does not all-reduce per micro-batch: the stage divides by the
    step's examples and all-reduces once (``gradmod.training.stage_sync``). ``sampling="poisson"``:
    each step's batch is a Poisson sample of the training set
    (``gradmod.training.loader.poisson_batches``), split into the step's micro-batches."""

    batch_size: int = 100
    accumulate: int = 1
    eval_batch_size: int = 1000
    log_every: int = 50
    progress: bool = False
    loader_workers: int | None = None
    sampling: str = "shuffle"


class Trainer:
    """Trains ``model`` with ``optimizer`` as ``settings`` say; callbacks act at its moments.

    ``net``: what the forward pass runs through (``model`` wrapped in DDP or compiled;
    ``model`` itself by default); ``eval_net``: what evaluation runs through. ``hooks``: a
    ``HookSet`` whose fused stage runs before each optimizer step, or an object of one's own
    that answers ``gradmod.training.loop_hooks.Hooks`` (what stages answer, ``StagedHooks``,
    it may leave out). ``dist``: this process's rank and device; each rank trains on its
    share of every epoch's seeded permutation.

    Callbacks may read: ``epoch``, ``step`` (optimizer steps so far), ``batch`` (batches of
    this epoch done, of ``epoch_batches``), ``history`` (one record per finished epoch), ``last_stats``, ``settings``.
    """

    dataset_index: Tensor | None = None  # fit's: positions in a kept share (data.keep) -> whole-set indices
    epoch_batches = 0  # the (micro-)batches of this rank's epoch in progress

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        settings: TrainerSettings = TrainerSettings(),
        *,
        hooks: Hooks | None = None,
        amp: Precision | None = None,
        callbacks: Sequence[Any] = (),
        dist: Dist | None = None,
        net: nn.Module | None = None,
        eval_net: nn.Module | None = None,
        generator: torch.Generator | None = None,
        loss_fn: Callable[[Tensor, Tensor], Tensor] = F.cross_entropy,
        tasks: Tasks | None = None,
    ):
        self.model, self.optimizer, self.settings, self.hooks = model, optimizer, settings, hooks
        self.net = model if net is None else net
        self.eval_net = model if eval_net is None else eval_net
        self.dist = dist or Dist(device=next(model.parameters()).device)
        self.device = self.dist.device
        self.amp = amp or Precision("fp32", self.device)
        self.callbacks: list[Any] = []
        self.add_callbacks(callbacks)
        self.loss_fn = loss_fn
        self.tasks = tasks if tasks is not None else Tasks(loss_fn)  # the loss and metric, per task
        self.generator = generator if generator is not None else torch.Generator().manual_seed(0)
        # Where training stands (checkpoints save and restore exactly this).
        self.epoch, self.batch, self.step, self.skipped = 1, 0, 0, 0
        self._skipped_before = 0  # ``skipped`` at the start of the epoch in progress
        self.epoch_order: Tensor | None = None  # the generator's state at this epoch's start
        self.loss_sum = torch.zeros((), device=self.device)  # this epoch's summed loss, on the device
        self.step_loss: Tensor | None = None  # this optimizer step's summed micro-batch losses, on the device
        self.history: list[dict[str, Any]] = []
        self.last_stats: dict[str, Any] = {}  # the latest non-empty read of the `log` statistics
        self.resumed_from = None
        self.staged: StagedHooks | None = hooks if isinstance(hooks, StagedHooks) else None  # None: no stages
        # What the hook stages need from this loop (gradmod.training.stage_sync): DDP's all-reduce
        # or not, the manual means, whether the loss of a micro-batch is divided.
        self.stage_sync = StageSync(
            self.staged,
            self.dist,
            poisson=settings.sampling == "poisson",
            batch_size=settings.batch_size,
            accumulate=settings.accumulate,
        )
        # The stage keeping per-example scores: told each batch's indices in the whole training set.
        self.scores = self.staged.keeping_scores if self.staged is not None else None
        wants = self.staged is not None and self.staged.wants_step_losses  # famo's, gradmod.training.after_step
        self.after_step = AfterStepLosses(self.staged, self.net, self.tasks, self.amp) if wants else None

    def add_callbacks(self, callbacks: Sequence[Any]) -> None:
        """Append ``callbacks``; a ``ValueError`` where the order breaks what they declare
        (``gradmod.training.callbacks.check_order``)."""
        check_order([*self.callbacks, *callbacks])
        self.callbacks.extend(callbacks)

    def fit(self, data: Data, epochs: int) -> list[dict[str, Any]]:
        """Train until ``epochs`` epochs are done (from where a restored checkpoint left off)."""
        self.data = data
        self.dataset_index = None if data.train_index is None else data.train_index.to(self.device)
        self._call("on_fit_start")
        first = self.epoch if self.epoch_order is not None else len(self.history) + 1  # resumed: go on
        for epoch in tqdm(range(first, epochs + 1), desc="epochs", disable=not self.settings.progress):
            self.epoch = epoch
            t0 = time.perf_counter()
            train_loss = self.train_epoch(data.train_x, data.train_y)
            t1 = time.perf_counter()
            test = self.test(data)
            (train_loss,) = self.dist.mean([train_loss])
            record = {
                "epoch": epoch,
                "step": self.step,
                "train_loss": train_loss,
                "test_loss": test["test_loss"],
                "test_accuracy": test["test_accuracy"],
                "test_metric": test["test_metric"],
                "seconds": time.perf_counter() - t0,
                "train_seconds": t1 - t0,
                "eval_seconds": time.perf_counter() - t1,
                "skipped_steps": self.skipped - self._skipped_before,
                **({"tasks": test["tasks"]} if "tasks" in test else {}),
            }
            stats = self.log_point() or self.last_stats  # the latest buffer: pending now, else the last read
            if stats:
                record["grad_stats"] = stats
            self.history.append(record)
            self._call("on_epoch_end", record)
        self._call("on_fit_end")
        return self.history

    def train_epoch(self, x: Tensor, y: Tensor) -> float:
        """One pass over this rank's share of (x, y), or its rest when resuming mid-epoch;
        returns the mean loss, read from the device once."""
        self.net.train()
        s = self.settings
        if self.batch == 0:
            self.epoch_order = self.generator.get_state()  # with ``batch``: the data-order position
            self._skipped_before = self.skipped  # resumed mid-epoch: restored with the position
        else:
            self.generator.set_state(self.epoch_order)
        start = self.batch
        total, stream = self._stream(x, y, start)
        self.epoch_batches = total
        for i, (xb, yb, *index) in enumerate(
            tqdm(stream, total=total, initial=start, leave=False, desc="train", disable=not s.progress), start=start + 1
        ):
            if (i - 1) % s.accumulate == 0:
                self._call("on_step_start")
                self.optimizer.zero_grad(set_to_none=True)
                self.step_loss = None
                group = min(s.accumulate, total - i + 1)  # micro-batches in this step (fewer at the end)
            last = i % s.accumulate == 0 or i == total  # the micro-batch that ends an optimizer step
            self._backward(xb, yb, group, sync=last, index=index[0] if index else None)
            if last:
                self.batch = i
                self._optimizer_step()
        mean = self.loss_sum.item() / max(total, 1)
        self.stage_sync.end_epoch()
        self.batch, self.epoch_order = 0, None
        self.loss_sum = torch.zeros((), device=self.device)
        return mean

    def _stream(self, x: Tensor, y: Tensor, start: int):
        """(micro-batches in this rank's epoch, their stream from batch ``start`` on)."""
        part = (self.dist.data_rank, self.dist.data_size)  # a tensor-parallel group shares its batches
        s, indexed = self.settings, self.scores is not None
        if s.sampling == "poisson":
            rate, steps = poisson_steps(len(y), s.batch_size, self.dist.data_size, s.accumulate)
            return steps * s.accumulate, poisson_batches(
                x, y, rate, steps, self.generator, s.accumulate, part, start, self.device, s.loader_workers, indexed
            )
        total = batches_per_epoch(len(y), s.batch_size, self.dist.data_size)
        stream = batches(
            x, y, s.batch_size, self.generator, part, start, self.device, s.loader_workers, indexed=indexed
        )
        return total, stream

    def _backward(self, xb: Tensor, yb: Any, group: int, sync: bool, index: Tensor | None = None) -> None:
        if len(yb) == 0:
            return  # an empty Poisson micro-batch: nothing to learn from (the step still runs)
        if index is not None:  # per-example scores are kept by dataset index
            self.scores.see_batch(index if self.dataset_index is None else self.dataset_index[index], yb)
        if self.stage_sync.divides_step:  # each example's own gradient: the stage divides the step's sum
            group = 1
        if not self.stage_sync.ddp_may_reduce:  # the stages reduce what they need after backward
            sync = False
        if self.staged is not None:
            self.staged.set_loss_divisor(group)
        if self.staged is not None and self.staged.forward_passes() > 1:
            losses = self._two_passes(xb, yb, group, sync)
        else:
            with no_sync(self.net, not sync):
                with self.amp.autocast():
                    losses = self.tasks.losses(self.net(xb), yb)  # one loss, or named ones
                self.amp.backward(scaled(losses, lambda t: t / group), self.hooks, self._closure(xb, yb, group, sync))
        if self.after_step is not None:
            self.after_step.keep(xb, yb)
        loss = total_loss(losses).detach()
        self.loss_sum += loss
        self.step_loss = loss if self.step_loss is None else self.step_loss + loss

    def _closure(self, xb: Tensor, yb: Any, group: int, sync: bool) -> Callable[[], Any] | None:
        """The micro-batch's losses recomputed at the current parameters, for a stage's
        second pass (DDP's forward decides whether its backward all-reduces); None for hooks
        without stages, whose ``backward`` takes the losses alone."""
        if self.staged is None:
            return None

        def closure():
            with no_sync(self.net, not sync), self.amp.autocast():
                return scaled(self.tasks.losses(self.net(xb), yb), lambda t: t / group)

        return closure

    def _two_passes(self, xb: Tensor, yb: Any, group: int, sync: bool) -> Any:
        """A micro-batch of two forward passes (a sharpness step): the first never
        all-reduces (under DDP each rank moves by its own gradient, the paper's
        m-sharpness), the second, through the closure, as usual."""
        with no_sync(self.net, True), self.amp.autocast():
            losses = self.tasks.losses(self.net(xb), yb)
        self.amp.backward(scaled(losses, lambda t: t / group), self.hooks, self._closure(xb, yb, group, sync))
        return losses

    def _optimizer_step(self) -> None:
        self._call("on_after_backward")  # raw .grad, before the fused stage changes it
        self.amp.unscale_(self.optimizer)  # the fused stage sees unscaled gradients
        skip = False
        self.stage_sync.before_finish()
        if self.hooks is not None and self.hooks.needs_after_backward:
            skip = bool(self.hooks.after_backward())  # True: a group transform asks to skip
        votes = [cb.on_before_optimizer_step(self) for cb in self.callbacks]  # every callback sees it
        skip = skip or any(votes)
        self.amp.step(self.optimizer, skip)
        if self.after_step is not None:
            self.after_step.after_step(taken=not skip)
        self.skipped += skip
        self.step += 1
        if self.step % self.settings.log_every == 0:
            self.log_point()
        self._call("on_step_end")

    def log_point(self) -> dict[str, Any]:
        """Read the ``log`` statistics (one host sync) and hand them to ``on_log``; returns
        them without histograms ({} when nothing was observed since the last read)."""
        stats = self.hooks.read_stats() if self.hooks is not None else {}
        if not stats:
            return {}
        self.last_stats = {k: {f: v for f, v in s.items() if f != "histogram"} for k, s in stats.items()}
        self._call("on_log", stats)  # with histograms; ``last_stats`` holds the same without
        return self.last_stats

    def test(self, data: Data) -> dict[str, Any]:
        """The record's test fields (``gradmod.training.tasks.results``): each rank evaluates
        its share, the means are combined."""
        test_y = data.test_y[self.dist.part]
        parts = None
        if self.dist.strategy == "fsdp":  # every forward gathers parameters: all ranks run as many
            parts = math.ceil(math.ceil(len(data.test_y) / self.dist.data_size) / self.settings.eval_batch_size)
        means, names = evaluate_tasks(
            self.eval_net,
            data.test_x[self.dist.part],
            test_y,
            self.tasks,
            batch_size=self.settings.eval_batch_size,
            device=self.device,
            loader_workers=self.settings.loader_workers,
            parts=parts,
            stand_in=(data.test_x[:1], data.test_y[:1]),  # a rank with an empty share still runs its forwards
        )
        combined = self.dist.mean(list(means.values()), weight=len(test_y))
        return results(dict(zip(means, combined)), names)

    def state_dict(self) -> dict[str, Any]:
        """Where training stands, for checkpoints: mid-epoch, the epoch in progress, the
        batches done in it, its order and loss so far; between epochs, the next epoch."""
        mid = self.epoch_order is not None
        return {
            "epoch": self.epoch if mid else len(self.history) + 1,
            "batch": self.batch if mid else 0,
            "step": self.step,
            "skipped": self.skipped,
            "generator": self.epoch_order if mid else self.generator.get_state(),
            "loss_sum": self.loss_sum.item() if mid else 0.0,
            "history": list(self.history),
            "epoch_skipped_before": self._skipped_before if mid else self.skipped,
            "optimizer": self.dist.optimizer_state(self.model, self.optimizer),
            "scaler": self.amp.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.dist.load_optimizer_state(self.model, self.optimizer, state["optimizer"])
        self.amp.load_state_dict(state["scaler"])
        self.step, self.skipped, self.history = state["step"], state["skipped"], list(state["history"])
        self.epoch, self.batch = state["epoch"], state["batch"]
        if self.batch:
            self.epoch_order = state["generator"]
            self.loss_sum = torch.tensor(state["loss_sum"], device=self.device)
            self._skipped_before = state.get("epoch_skipped_before", self.skipped)
        else:
            self.generator.set_state(state["generator"])

    def _call(self, moment: str, *args: Any) -> None:
        for cb in self.callbacks:
            getattr(cb, moment)(self, *args)


@torch.no_grad()
def evaluate(
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    *,
    batch_size: int = 1000,
    device: torch.device | None = None,
    loader_workers: int | None = None,
    parts: int | None = None,
) -> tuple[float, float]:
    """Batched evaluation of a classifier: (mean cross-entropy, accuracy), read from the
    device once (``gradmod.training.tasks.evaluate`` for any loss and metric). ``parts``:
    exactly that many batches of near-equal size instead (FSDP2's ranks)."""
    means, _ = evaluate_tasks(
        model, x, y, CROSS_ENTROPY, batch_size=batch_size, device=device, loader_workers=loader_workers, parts=parts
    )
    return means["loss"], means["metric/"]
