"""Training: one run from a config, and the epoch and evaluation loops it is made of."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch import Tensor, nn
from tqdm.auto import tqdm

from gradmod.training import checkpoint as ckpt
from gradmod.app.config import validate
from gradmod.data import as_float, load_data
from gradmod.training.distributed import Dist, no_sync, unwrap
from gradmod.weight_init import apply_init
from gradmod.training.loader import host_batches, placement
from gradmod.models import build_model
from gradmod.training.nonfinite import NonFiniteGuard
from gradmod.training.precision import Precision, check_precision
from gradmod.reporting.observe import RunWatch
from gradmod.hooks.rules import HookSet, attach
from gradmod.training.speed import SyncCheck, compile_model, to_channels_last

log = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    """``auto`` -> CUDA when available, else the CPU; asking for missing CUDA is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"trainer.device={name!r} is not a device; allowed: auto, cpu, cuda, cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"trainer.device={name!r} but CUDA is not available here; use trainer.device=auto or cpu")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"trainer.device={name!r} is not supported; allowed: auto, cpu, cuda, cuda:N")
    return device


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def batches(x: Tensor, y: Tensor, batch_size: int, generator: torch.Generator | None = None,
            shard: tuple[int, int] = (0, 1), start: int = 0, device: torch.device | None = None,
            loader_workers: int | None = None) -> Iterator[tuple[Tensor, Tensor]]:
    """Batches of (float images, labels) indexed from tensors already on the device;
    shuffled by ``generator`` (a CPU generator) when one is given. ``shard=(rank, world)``
    keeps this rank's share of the shuffled order; ``start`` skips that many batches of it
    (resuming mid-epoch). With ``loader_workers`` set, a DataLoader gathers the same
    batches from host memory and copies them to ``device`` (``gradmod.training.loader``)."""
    device = x.device if device is None else device
    if generator is None:
        if loader_workers is not None:
            yield from host_batches(x, y, torch.arange(len(y)).split(batch_size), device, loader_workers)
            return
        for xb, yb in zip(x.split(batch_size), y.split(batch_size)):
            yield as_float(xb), yb
        return
    order = torch.randperm(len(y), generator=generator)
    rank, world = shard
    if world > 1:  # every rank draws the same permutation: rank r takes every world-th index,
        order = order[rank:len(order) - len(order) % world:world]  # all ranks the same count
    if loader_workers is not None:
        yield from host_batches(x, y, order.split(batch_size)[start:], device, loader_workers)
        return
    for idx in order.to(y.device).split(batch_size)[start:]:
        yield as_float(x[idx]), y[idx]


def batches_per_epoch(n: int, batch_size: int, world: int = 1) -> int:
    """Batches in one rank's share of an epoch (``batches`` gives each rank n // world items)."""
    return math.ceil(n // world / batch_size)


def train_epoch(model: nn.Module, optimizer: torch.optim.Optimizer, x: Tensor, y: Tensor, *,
                batch_size: int, generator: torch.Generator, hooks: HookSet | None = None,
                on_step: Callable[[int], None] | None = None, progress: bool = False,
                accumulate: int = 1, shard: tuple[int, int] = (0, 1),
                amp: Precision | None = None, guard: NonFiniteGuard | None = None,
                start: int = 0, total: Tensor | None = None, device: torch.device | None = None,
                loader_workers: int | None = None) -> float:
    """One pass over (x, y) in shuffled batches; returns the mean training loss.

    The loss is summed on the device and read once at the end: no per-step host sync.
    ``on_step(i)`` runs after each optimizer step (``i`` counts from 1 in this epoch).
    ``accumulate=k``: k batches (micro-batches) per optimizer step, each loss divided by
    the number in its step; under DDP only the last one all-reduces. ``shard``: see ``batches``.
    ``amp`` sets the precision (fp32 without it); ``guard`` counts non-finite gradients and
    may skip a step. Resuming: ``start`` batches (a whole number of optimizer steps) are
    done, their loss summed in ``total``. ``device``, ``loader_workers``: see ``batches``.
    """
    model.train()
    device = y.device if device is None else device
    amp = amp or Precision("fp32", device)
    total = torch.zeros((), device=device) if total is None else total
    n = start
    steps = batches_per_epoch(len(y), batch_size, shard[1])
    for i, (xb, yb) in enumerate(tqdm(batches(x, y, batch_size, generator, shard, start, device, loader_workers), total=steps,
                                      initial=start, leave=False, desc="train", disable=not progress),
                                 start=start + 1):
        last = i % accumulate == 0 or i == steps  # the micro-batch that ends an optimizer step
        if (i - 1) % accumulate == 0:
            optimizer.zero_grad(set_to_none=True)
            group = min(accumulate, steps - i + 1)  # micro-batches in this step (fewer at the end)
        with no_sync(model, not last):
            with amp.autocast():
                loss = F.cross_entropy(model(xb), yb)
            amp.backward(loss / group, hooks)
        total += loss.detach()
        n += 1
        if not last:
            continue
        if guard is not None:
            guard.observe()  # raw .grad of what no hook saw, before the fused stage
        amp.unscale_(optimizer)  # the fused stage sees unscaled gradients
        if hooks is not None and hooks.has_fused:
            hooks.after_backward()
        skip = guard is not None and guard.check(amp.scale())
        amp.step(optimizer, skip)
        if on_step is not None:
            on_step(math.ceil(i / accumulate))
    return total.item() / max(n, 1)


@torch.no_grad()
def evaluate(model: nn.Module, x: Tensor, y: Tensor, *, batch_size: int = 1000,
             device: torch.device | None = None, loader_workers: int | None = None) -> tuple[float, float]:
    """Batched evaluation: (mean loss, accuracy), read from the device once."""
    model.eval()
    device = y.device if device is None else device
    loss = torch.zeros((), device=device)
    correct = torch.zeros((), device=device, dtype=torch.long)
    for xb, yb in batches(x, y, batch_size, device=device, loader_workers=loader_workers):
        out = model(xb)
        loss += F.cross_entropy(out, yb, reduction="sum")
        correct += (out.argmax(1) == yb).sum()
    loss_sum, n_correct = torch.stack([loss, correct.to(loss.dtype)]).tolist()
    return loss_sum / len(y), n_correct / len(y)


def _progress_enabled(flag: bool) -> bool:
    return bool(flag) and sys.stderr.isatty()


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    tmp.replace(path)


def run(cfg: DictConfig, out_dir: str | Path) -> dict[str, Any]:
    """Train as ``cfg`` says and write the run folder; returns the summary."""
    validate(cfg)  # schemas and values, before anything is built
    t_start = time.perf_counter()
    threads = torch.get_num_threads()  # trainer.threads holds for this run only (in-process sweeps)
    try:
        return _run(cfg, Path(out_dir), t_start)
    finally:
        torch.set_num_threads(threads)


def _run(cfg: DictConfig, out: Path, t_start: float) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    trainer = cfg.trainer
    for key in ("epochs", "log_every", "eval_batch_size", "accumulate"):
        if int(trainer[key]) < 1:
            raise ValueError(f"trainer.{key}={trainer[key]} must be >= 1")
    if int(cfg.data.batch_size) < 1:
        raise ValueError(f"data.batch_size={cfg.data.batch_size} must be >= 1")
    dist = Dist.from_env(str(trainer.strategy), resolve_device(str(trainer.device)))
    device = dist.device  # under DDP on GPUs: cuda:LOCAL_RANK
    check_precision(str(trainer.get("precision", "fp32")), device)
    if dist.world_size > 1 and trainer.get("resume"):
        raise ValueError("trainer.resume with trainer.strategy=ddp is not supported yet (ranks > 0 have no "
                         "run folder to find checkpoints in); resume with strategy=single")
    if trainer.get("threads"):
        torch.set_num_threads(int(trainer.threads))
    seed_everything(int(cfg.seed))

    data_cfg = OmegaConf.to_container(cfg.data, resolve=True)
    batch_size = int(data_cfg.pop("batch_size"))
    data = load_data(data_cfg.pop("name"), data_dir=str(cfg.data_dir), seed=int(cfg.seed),
                     fallback=bool(data_cfg.pop("fallback", True)), n_test=int(data_cfg.pop("n_test", 1000)),
                     **data_cfg)
    loader_workers = None  # None: batches indexed on the device; else a DataLoader's workers
    if placement(str(trainer.get("data_placement", "auto")), data, device) == "device":
        data = data.to(device)
    else:
        loader_workers = int(trainer.get("loader_workers", 0))
        if loader_workers < 0:
            raise ValueError(f"trainer.loader_workers={loader_workers} must be >= 0")
    model = build_model(cfg.model.name, in_channels=data.in_channels, num_classes=data.num_classes,
                        image_size=data.image_size)
    apply_init(model, cfg.init.name)
    model.to(device)
    if trainer.get("channels_last"):
        to_channels_last(model)  # same Parameter objects: attach before or after is the same
    rules = OmegaConf.to_container(cfg.hooks, resolve=True) if cfg.get("hooks") else {}  # an empty DictConfig is falsy
    hooks = attach(model, rules, stage=str(trainer.hook_stage))  # before DDP: names without "module."
    try:
        return _fit(cfg, dist.wrap(model), data, hooks, device, batch_size, out, t_start, dist, loader_workers)
    finally:
        hooks.remove()
        dist.close()


def _fit(cfg, model, data, hooks, device, batch_size, out, t_start: float, dist: Dist,
         loader_workers: int | None) -> dict[str, Any]:
    trainer = cfg.trainer
    log.info("%s", hooks.format_plan())
    plan = hooks.describe()
    if dist.is_main:  # rank 0 alone writes the run folder; other ranks write to os.devnull
        _write_json(out / "hook_plan.json", plan)
    optimizer = instantiate(cfg.optimizer)(model.parameters())
    # Hooks are attached to the plain model already; the compiled module shares its parameters.
    net = compile_model(model) if trainer.get("compile") else model
    sync_check = SyncCheck(bool(trainer.get("sync_check", False)), device)
    generator = torch.Generator().manual_seed(int(cfg.seed))
    amp = Precision(str(trainer.get("precision", "fp32")), device)
    guard = NonFiniteGuard(unwrap(model), hooks, str(trainer.get("nonfinite", "warn")),
                           world_sum=_world_sum if dist.world_size > 1 else None)
    saver = _Saver(cfg, out / "checkpoints", unwrap(model), optimizer, amp, guard, hooks, dist.is_main)
    pos, resumed_from = saver.resume(trainer.get("resume"))
    progress = _progress_enabled(trainer.progress)
    log_every, epochs, accumulate = int(trainer.log_every), int(trainer.epochs), int(trainer.accumulate)
    history: list[dict[str, Any]] = pos.history
    step = pos.step
    n_batches = batches_per_epoch(len(data.train_y), batch_size, dist.world_size)
    every_epochs, every_steps = int(trainer.get("checkpoint_every", 0)), int(trainer.get("checkpoint_every_steps", 0))
    steps_per_epoch = math.ceil(n_batches / accumulate)
    with _RunFiles(cfg, out, hooks, data, device, dist.is_main, pos.step if resumed_from else None) as files:
        files.replay(history)  # resumed: what the checkpoint knew; later lines are redone
        try:
            for epoch in tqdm(range(pos.epoch, epochs + 1), desc="epochs", disable=not progress):
                resuming = epoch == pos.epoch and resumed_from is not None
                if resuming:
                    generator.set_state(pos.generator)
                epoch_order = generator.get_state()  # with the batch index, the data-order position
                total = torch.tensor(pos.loss_sum if resuming else 0.0, device=device)
                skipped_before = guard.skipped

                def on_step(i: int) -> None:
                    nonlocal step
                    sync_check.allow()  # reads, checkpoints and the epoch's end may sync
                    step += 1
                    if step % log_every == 0:
                        files.flush_stats(epoch, step)
                    if every_steps and step % every_steps == 0:
                        done = min(i * accumulate, n_batches)  # batches behind optimizer step i
                        saver.save(ckpt.Position(epoch, done, step, epoch_order, total.item(), history))
                    files.watch.before_step(step + 1)
                    ckpt.kill_point("step", step)
                    if i < steps_per_epoch:  # the steps up to the next log point must not sync
                        sync_check.forbid()

                t0 = time.perf_counter()
                train_loss = train_epoch(net, optimizer, data.train_x, data.train_y, batch_size=batch_size,
                                         generator=generator, hooks=hooks, on_step=on_step, progress=progress,
                                         accumulate=accumulate, shard=(dist.rank, dist.world_size),
                                         amp=amp, guard=guard, start=pos.batch if resuming else 0, total=total,
                                         device=device, loader_workers=loader_workers)
                guard.flush()
                t1 = time.perf_counter()
                test_loss, test_accuracy = _test_metrics(unwrap(model) if net is model else net, data, dist,
                                                         int(trainer.eval_batch_size), device, loader_workers)
                train_loss, = dist.mean([train_loss])
                t2 = time.perf_counter()
                record = {"epoch": epoch, "step": step, "train_loss": train_loss, "test_loss": test_loss,
                          "test_accuracy": test_accuracy, "seconds": t2 - t0, "train_seconds": t1 - t0,
                          "eval_seconds": t2 - t1, "skipped_steps": guard.skipped - skipped_before}
                # The latest window of `log` statistics: what is pending now, else the last read.
                stats = files.flush_stats(epoch, step) or files.last_stats
                if stats:
                    record["grad_stats"] = stats
                files.write_record(record)
                history.append(record)
                files.watch.on_epoch(record, unwrap(model))
                if every_epochs and (epoch % every_epochs == 0 or epoch == epochs):
                    saver.save(ckpt.Position(epoch + 1, 0, step, generator.get_state(), 0.0, history))
                log.info("epoch %d/%d  train_loss %.4f  test_loss %.4f  test_accuracy %.4f  (%.1fs)",
                         epoch, epochs, train_loss, test_loss, test_accuracy, t2 - t0)
        finally:
            sync_check.allow()

    if dist.is_main:
        torch.save(unwrap(model).state_dict(), out / "model.pt")
        from gradmod.reporting.plots import plot_curves

        plot_curves(history, out / "curves.png")
        files.watch.finish(unwrap(model))
    summary = _summary(cfg, data, model, device, dist, history, step, plan, guard, amp, resumed_from,
                       time.perf_counter() - t_start)
    if dist.is_main:
        _write_json(out / "summary.json", summary)
    log.info("test_accuracy %.4f on %s (%d test images) in %.1fs; run folder %s",
             summary["test_accuracy"], data.name, summary["test_size"], summary["seconds"], out)
    return summary


def _test_metrics(model: nn.Module, data, dist: Dist, batch_size: int, device: torch.device,
                  loader_workers: int | None) -> tuple[float, float]:
    """(test loss, test accuracy): each rank evaluates its share, the means are combined."""
    test_y = data.test_y[dist.shard]
    loss, accuracy = evaluate(model, data.test_x[dist.shard], test_y, batch_size=batch_size, device=device,
                              loader_workers=loader_workers)
    loss, accuracy = dist.mean([loss, accuracy], weight=len(test_y))
    return loss, accuracy


def _summary(cfg, data, model, device, dist, history, step, plan, guard, amp, resumed_from,
             seconds: float) -> dict[str, Any]:
    """summary.json: the last epoch's numbers and what the run was."""
    last = history[-1]
    return {
        "status": "ok",
        "test_accuracy": last["test_accuracy"],
        "test_loss": last["test_loss"],
        "train_loss": last["train_loss"],
        "dataset": data.name,
        "train_size": len(data.train_y),
        "test_size": len(data.test_y),
        "model": cfg.model.name,
        "num_params": sum(p.numel() for p in model.parameters()),
        "device": str(device),
        "epochs": len(history),
        "steps": step,
        "seed": int(cfg.seed),
        "world_size": dist.world_size,
        "threads": torch.get_num_threads(),
        "hook_plan": plan,
        "skipped_steps": guard.skipped,
        "nonfinite_steps": guard.bad_steps,
        "nonfinite": guard.nonfinite,
        "precision": amp.name,
        "resumed_from": str(resumed_from) if resumed_from else None,
        "seconds": seconds,
    }


class _RunFiles:
    """What a run keeps open in its folder: the logger, plots and Grad-CAM (``RunWatch``),
    metrics.jsonl, grad_stats.jsonl (when a ``log`` is attached) and, on ranks > 0, a
    scratch folder standing in for the run folder. Use as a ``with`` block: whatever was
    opened is closed however the run ends, also when opening a later one fails."""

    def __init__(self, cfg, out: Path, hooks: HookSet, data, device: torch.device, is_main: bool,
                 resumed_step: int | None):
        self.hooks = hooks
        self.last_stats: dict[str, Any] = {}  # the latest non-empty read
        self._stack = contextlib.ExitStack()
        try:
            folder = out
            if not is_main:  # rank 0 alone writes the run folder
                folder = Path(self._stack.enter_context(tempfile.TemporaryDirectory()))
            self.watch = RunWatch(cfg, folder, hooks, data, device)
            self._stack.callback(self.watch.close)
            self.metrics = self._stack.enter_context(open(out / "metrics.jsonl" if is_main else os.devnull, "w"))
            self.stats = None
            if hooks.observers():
                self.stats = self._stack.enter_context(
                    _open_stats(out / "grad_stats.jsonl", resumed_step, self.watch) if is_main
                    else open(os.devnull, "w"))
        except BaseException:
            self.close()
            raise

    def replay(self, history: list[dict[str, Any]]) -> None:
        """Resumed: write the checkpoint's epoch records again (the logger starts afresh)."""
        for record in history:
            self.metrics.write(json.dumps(record) + "\n")
            self.watch.logger.log_metrics(int(record["step"]), record)

    def flush_stats(self, epoch: int, step: int) -> dict[str, Any]:
        """Read the `log` windows (one host sync), pass them to the logger and write them."""
        stats = self.watch.on_stats(epoch, step, self.hooks.read_stats())
        if stats and self.stats is not None:
            self.last_stats = stats
            self.stats.write(json.dumps({"epoch": epoch, "step": step, "stats": stats}) + "\n")
            self.stats.flush()
        return stats

    def write_record(self, record: dict[str, Any]) -> None:
        self.metrics.write(json.dumps(record) + "\n")
        self.metrics.flush()

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> "_RunFiles":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _world_sum(t: Tensor) -> Tensor:
    torch.distributed.all_reduce(t)
    return t


def _open_stats(path: Path, resumed_step: int | None, watch):
    """grad_stats.jsonl; resumed: keep the lines up to the checkpoint's step (and pass them
    to the logger and plots again, whose files start afresh), then append."""
    if resumed_step is None or not path.exists():
        return open(path, "w")
    kept = [(ln, rec) for ln, rec in _stats_lines(path) if rec["step"] <= resumed_step]
    f = open(path, "w")
    f.write("".join(ln + "\n" for ln, _ in kept))
    for _, rec in kept:
        watch.on_stats(rec["epoch"], rec["step"], rec["stats"])
    return f


def _stats_lines(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """(line, record) of grad_stats.jsonl; a line cut short (a run killed mid-write) is dropped."""
    out = []
    for ln in path.read_text().splitlines():
        try:
            rec = json.loads(ln)
        except ValueError:
            continue
        if isinstance(rec, dict) and {"epoch", "step", "stats"} <= rec.keys():
            out.append((ln, rec))
    return out


class _Saver:
    """Writes and restores checkpoints of one run (``gradmod.training.checkpoint`` does the files)."""

    def __init__(self, cfg, folder, model, optimizer, amp, guard, hooks, writes: bool = True):
        self.cfg, self.folder, self.model, self.optimizer, self.writes = cfg, folder, model, optimizer, writes
        self.amp, self.guard, self.hooks, self.plan = amp, guard, hooks, hooks.describe()
        self.keep = int(cfg.trainer.get("checkpoint_keep", 2))

    def save(self, pos: ckpt.Position) -> None:
        if not self.writes:  # DDP: rank 0 writes; the others hold the same state
            return
        state = {"format": 1, "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                 "scaler": self.amp.state_dict(), "guard": self.guard.state_dict(),
                 "epoch": pos.epoch, "batch": pos.batch, "step": pos.step, "generator": pos.generator,
                 "loss_sum": pos.loss_sum, "history": pos.history, "rng": ckpt.rng_state(),
                 "config": OmegaConf.to_yaml(self.cfg), "hook_plan": self.plan,
                 "hooks": self.hooks.state_dict()}
        path = ckpt.save(self.folder, state, self.keep)
        log.debug("checkpoint %s (epoch %d, batch %d)", path, pos.epoch, pos.batch)

    def resume(self, resume: str | None) -> tuple[ckpt.Position, Path | None]:
        found = ckpt.find(resume, self.folder)
        if found is None:
            return ckpt.Position(), None
        path, state = found
        if state.get("hook_plan") != self.plan:
            log.warning("resuming from %s, whose hook plan differs from this run's", path)
        try:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        except (RuntimeError, ValueError, KeyError) as e:
            raise ValueError(f"trainer.resume: {path} does not fit this model/optimizer "
                             f"({str(e).strip().splitlines()[0]})") from None
        self.amp.load_state_dict(state["scaler"])
        self.guard.load_state_dict({"steps": state["step"], **state["guard"]})  # older files lack guard steps
        if "hooks" in state:  # the `log` windows in progress (and any other hook state)
            self.hooks.load_state_dict(state["hooks"], next(self.model.parameters()).device)
        ckpt.set_rng_state(state["rng"])
        log.info("resumed from %s: epoch %d, batch %d, step %d", path, state["epoch"], state["batch"], state["step"])
        return ckpt.Position(state["epoch"], state["batch"], state["step"], state["generator"],
                             state["loss_sum"], list(state["history"])), path
