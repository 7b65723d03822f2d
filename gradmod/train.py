"""Training: one run from a config, and the epoch and evaluation loops it is made of."""

from __future__ import annotations

import json
import logging
import random
import sys
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

from gradmod import checkpoint as ckpt
from gradmod.config import validate
from gradmod.data import as_float, load_data
from gradmod.init import apply_init
from gradmod.models import build_model
from gradmod.nonfinite import NonFiniteGuard
from gradmod.precision import Precision, check_precision
from gradmod.observe import RunWatch
from gradmod.rules import HookSet, attach

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
            start: int = 0) -> Iterator[tuple[Tensor, Tensor]]:
    """Batches of (float images, labels) indexed from tensors already on the device;
    shuffled by ``generator`` (a CPU generator) when one is given. ``start`` skips that
    many batches of the order (resuming mid-epoch)."""
    if generator is None:
        for xb, yb in zip(x.split(batch_size), y.split(batch_size)):
            yield as_float(xb), yb
        return
    order = torch.randperm(len(y), generator=generator).to(y.device)
    for idx in order.split(batch_size)[start:]:
        yield as_float(x[idx]), y[idx]


def train_epoch(model: nn.Module, optimizer: torch.optim.Optimizer, x: Tensor, y: Tensor, *,
                batch_size: int, generator: torch.Generator, hooks: HookSet | None = None,
                on_step: Callable[[int], None] | None = None, progress: bool = False,
                amp: Precision | None = None, guard: NonFiniteGuard | None = None,
                start: int = 0, total: Tensor | None = None) -> float:
    """One pass over (x, y) in shuffled batches; returns the mean training loss.

    The loss is summed on the device and read once at the end: no per-step host sync.
    ``on_step(i)`` runs after each optimizer step (``i`` counts from 1 in this epoch).
    ``amp`` sets the precision (fp32 without it); ``guard`` counts non-finite gradients and
    may skip a step. Resuming: ``start`` batches are done, their loss summed in ``total``.
    """
    model.train()
    amp = amp or Precision("fp32", y.device)
    total = torch.zeros((), device=y.device) if total is None else total
    n = start
    steps = (len(y) + batch_size - 1) // batch_size
    for i, (xb, yb) in enumerate(tqdm(batches(x, y, batch_size, generator, start), total=steps, initial=start,
                                      leave=False, desc="train", disable=not progress), start=start + 1):
        with amp.autocast():
            loss = F.cross_entropy(model(xb), yb)
        optimizer.zero_grad(set_to_none=True)
        amp.backward(loss, hooks)
        if guard is not None:
            guard.observe()  # raw .grad of what no hook saw, before the fused stage
        amp.unscale_(optimizer)  # the fused stage sees unscaled gradients
        if hooks is not None and hooks.has_fused:
            hooks.after_backward()
        skip = guard is not None and guard.check(amp.scale())
        amp.step(optimizer, skip)
        total += loss.detach()
        n += 1
        if on_step is not None:
            on_step(i)
    return total.item() / max(n, 1)


@torch.no_grad()
def evaluate(model: nn.Module, x: Tensor, y: Tensor, *, batch_size: int = 1000) -> tuple[float, float]:
    """Batched evaluation: (mean loss, accuracy), read from the device once."""
    model.eval()
    loss = torch.zeros((), device=y.device)
    correct = torch.zeros((), device=y.device, dtype=torch.long)
    for xb, yb in batches(x, y, batch_size):
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
    start = time.perf_counter()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    trainer = cfg.trainer
    for key in ("epochs", "log_every", "eval_batch_size"):
        if int(trainer[key]) < 1:
            raise ValueError(f"trainer.{key}={trainer[key]} must be >= 1")
    if int(cfg.data.batch_size) < 1:
        raise ValueError(f"data.batch_size={cfg.data.batch_size} must be >= 1")
    device = resolve_device(str(trainer.device))
    check_precision(str(trainer.get("precision", "fp32")), device)
    if trainer.get("threads"):
        torch.set_num_threads(int(trainer.threads))
    seed_everything(int(cfg.seed))

    data_cfg = OmegaConf.to_container(cfg.data, resolve=True)
    batch_size = int(data_cfg.pop("batch_size"))
    data = load_data(data_cfg.pop("name"), data_dir=str(cfg.data_dir), seed=int(cfg.seed),
                     fallback=bool(data_cfg.pop("fallback", True)), n_test=int(data_cfg.pop("n_test", 1000)),
                     **data_cfg).to(device)
    model = build_model(cfg.model.name, in_channels=data.in_channels, num_classes=data.num_classes,
                        image_size=data.image_size)
    apply_init(model, cfg.init.name)
    model.to(device)
    rules = OmegaConf.to_container(cfg.hooks, resolve=True) if cfg.get("hooks") else {}  # an empty DictConfig is falsy
    hooks = attach(model, rules, stage=str(trainer.hook_stage))
    try:
        return _fit(cfg, model, data, hooks, device, batch_size, out, start)
    finally:
        hooks.remove()


def _fit(cfg, model, data, hooks, device, batch_size, out, start) -> dict[str, Any]:
    trainer = cfg.trainer
    log.info("%s", hooks.format_plan())
    plan = hooks.describe()
    _write_json(out / "hook_plan.json", plan)
    optimizer = instantiate(cfg.optimizer)(model.parameters())
    generator = torch.Generator().manual_seed(int(cfg.seed))
    amp = Precision(str(trainer.get("precision", "fp32")), device)
    guard = NonFiniteGuard(model, hooks, str(trainer.get("nonfinite", "warn")))
    saver = _Saver(cfg, out / "checkpoints", model, optimizer, amp, guard, hooks)
    pos, resumed_from = saver.resume(trainer.get("resume"))
    progress = _progress_enabled(trainer.progress)
    log_every = int(trainer.log_every)
    epochs = int(trainer.epochs)
    history: list[dict[str, Any]] = pos.history
    step = pos.step
    watch = RunWatch(cfg, out, hooks, data, device)  # logger, plots, Grad-CAM (gradmod/observe.py)
    metrics_file = open(out / "metrics.jsonl", "w")
    stats_file = _open_stats(out / "grad_stats.jsonl", pos.step if resumed_from else None, watch) \
        if hooks.observers() else None
    for record in history:  # resumed: what the checkpoint knew; later lines were redone
        metrics_file.write(json.dumps(record) + "\n")
        watch.logger.log_metrics(int(record["step"]), record)

    last_stats: dict[str, Any] = {}

    def flush_stats(epoch: int) -> dict[str, Any]:
        nonlocal last_stats
        stats = watch.on_stats(epoch, step, hooks.read_stats())
        if stats and stats_file is not None:
            last_stats = stats
            stats_file.write(json.dumps({"epoch": epoch, "step": step, "stats": stats}) + "\n")
            stats_file.flush()
        return stats

    every_epochs, every_steps = int(trainer.get("checkpoint_every", 0)), int(trainer.get("checkpoint_every_steps", 0))
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
                step += 1
                if step % log_every == 0:
                    flush_stats(epoch)
                if every_steps and step % every_steps == 0:
                    saver.save(ckpt.Position(epoch, i, step, epoch_order, total.item(), history))
                watch.before_step(step + 1)
                ckpt.kill_point("step", step)

            t0 = time.perf_counter()
            train_loss = train_epoch(model, optimizer, data.train_x, data.train_y, batch_size=batch_size,
                                     generator=generator, hooks=hooks, on_step=on_step, progress=progress,
                                     amp=amp, guard=guard, start=pos.batch if resuming else 0, total=total)
            guard.flush()
            t1 = time.perf_counter()
            test_loss, test_accuracy = evaluate(model, data.test_x, data.test_y,
                                                batch_size=int(trainer.eval_batch_size))
            t2 = time.perf_counter()
            record = {"epoch": epoch, "step": step, "train_loss": train_loss, "test_loss": test_loss,
                      "test_accuracy": test_accuracy, "seconds": t2 - t0, "train_seconds": t1 - t0,
                      "eval_seconds": t2 - t1, "skipped_steps": guard.skipped - skipped_before}
            # The latest window of `log` statistics: what is pending now, else the last read.
            stats = flush_stats(epoch) or last_stats
            if stats:
                record["grad_stats"] = stats
            metrics_file.write(json.dumps(record) + "\n")
            metrics_file.flush()
            history.append(record)
            watch.on_epoch(record, model)
            if every_epochs and (epoch % every_epochs == 0 or epoch == epochs):
                saver.save(ckpt.Position(epoch + 1, 0, step, generator.get_state(), 0.0, history))
            log.info("epoch %d/%d  train_loss %.4f  test_loss %.4f  test_accuracy %.4f  (%.1fs)",
                     epoch, epochs, train_loss, test_loss, test_accuracy, t2 - t0)
    finally:
        metrics_file.close()
        if stats_file is not None:
            stats_file.close()
        watch.close()

    torch.save(model.state_dict(), out / "model.pt")
    from gradmod.viz import plot_curves

    plot_curves(history, out / "curves.png")
    watch.finish(model)
    last = history[-1]
    summary = {
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
        "hook_plan": plan,
        "skipped_steps": guard.skipped,
        "nonfinite_steps": guard.bad_steps,
        "nonfinite": guard.nonfinite,
        "precision": amp.name,
        "resumed_from": str(resumed_from) if resumed_from else None,
        "seconds": time.perf_counter() - start,
    }
    _write_json(out / "summary.json", summary)
    log.info("test_accuracy %.4f on %s (%d test images) in %.1fs; run folder %s",
             summary["test_accuracy"], data.name, summary["test_size"], summary["seconds"], out)
    return summary


def _open_stats(path: Path, resumed_step: int | None, watch):
    """grad_stats.jsonl; resumed: keep the lines up to the checkpoint's step (and pass them
    to the logger and plots again, whose files start afresh), then append."""
    if resumed_step is None or not path.exists():
        return open(path, "w")
    kept = [ln for ln in path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= resumed_step]
    f = open(path, "w")
    f.write("".join(ln + "\n" for ln in kept))
    for ln in kept:
        rec = json.loads(ln)
        watch.on_stats(rec["epoch"], rec["step"], rec["stats"])
    return f


class _Saver:
    """Writes and restores checkpoints of one run (``gradmod.checkpoint`` does the files)."""

    def __init__(self, cfg, folder, model, optimizer, amp, guard, hooks):
        self.cfg, self.folder, self.model, self.optimizer = cfg, folder, model, optimizer
        self.amp, self.guard, self.hooks, self.plan = amp, guard, hooks, hooks.describe()
        self.keep = int(cfg.trainer.get("checkpoint_keep", 2))

    def save(self, pos: ckpt.Position) -> None:
        state = {"format": 1, "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                 "scaler": self.amp.state_dict(), "guard": self.guard.state_dict(),
                 "epoch": pos.epoch, "batch": pos.batch, "step": pos.step, "generator": pos.generator,
                 "loss_sum": pos.loss_sum, "history": pos.history, "rng": ckpt.rng_state(),
                 "config": OmegaConf.to_yaml(self.cfg), "hook_plan": self.plan,
                 "log_windows": [(obs.calls, obs._sum) for _, obs in self.hooks.observers()]}
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
        self.guard.load_state_dict(state["guard"])
        observers = self.hooks.observers()
        if len(observers) == len(state["log_windows"]):  # the `log` windows in progress
            for (_, obs), (calls, acc) in zip(observers, state["log_windows"]):
                obs.calls, obs._sum = calls, None if acc is None else acc.to(next(self.model.parameters()).device)
        ckpt.set_rng_state(state["rng"])
        log.info("resumed from %s: epoch %d, batch %d, step %d", path, state["epoch"], state["batch"], state["step"])
        return ckpt.Position(state["epoch"], state["batch"], state["step"], state["generator"],
                             state["loss_sum"], list(state["history"])), path
