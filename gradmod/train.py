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

from gradmod.data import as_float, load_data
from gradmod.init import apply_init
from gradmod.loader import host_batches, placement
from gradmod.models import build_model
from gradmod.rules import HookSet, attach
from gradmod.speed import SyncCheck, compile_model, flag, to_channels_last

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
            device: torch.device | None = None, loader_workers: int | None = None) -> Iterator[tuple[Tensor, Tensor]]:
    """Batches of (float images, labels) indexed from tensors already on the device;
    shuffled by ``generator`` (a CPU generator) when one is given. With ``loader_workers``
    set, a DataLoader gathers them in host memory and copies them to ``device`` instead."""
    if loader_workers is not None:
        yield from host_batches(x, y, batch_size, generator, x.device if device is None else device, loader_workers)
        return
    if generator is None:
        for xb, yb in zip(x.split(batch_size), y.split(batch_size)):
            yield as_float(xb), yb
        return
    order = torch.randperm(len(y), generator=generator).to(y.device)
    for idx in order.split(batch_size):
        yield as_float(x[idx]), y[idx]


def train_epoch(model: nn.Module, optimizer: torch.optim.Optimizer, x: Tensor, y: Tensor, *,
                batch_size: int, generator: torch.Generator, hooks: HookSet | None = None,
                on_step: Callable[[int], None] | None = None, progress: bool = False,
                device: torch.device | None = None, loader_workers: int | None = None) -> float:
    """One pass over (x, y) in shuffled batches; returns the mean training loss.

    The loss is summed on the device and read once at the end: no per-step host sync.
    ``on_step(i)`` runs after each optimizer step (``i`` counts from 1 in this epoch).
    """
    model.train()
    device = y.device if device is None else device
    total = torch.zeros((), device=device)
    n = 0
    steps = (len(y) + batch_size - 1) // batch_size
    for i, (xb, yb) in enumerate(tqdm(batches(x, y, batch_size, generator, device, loader_workers), total=steps, leave=False,
                                      desc="train", disable=not progress), start=1):
        loss = F.cross_entropy(model(xb), yb)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if hooks is not None and hooks.has_fused:
            hooks.after_backward()
        optimizer.step()
        total += loss.detach()
        n += 1
        if on_step is not None:
            on_step(i)
    return total.item() / max(n, 1)


@torch.no_grad()
def evaluate(model: nn.Module, x: Tensor, y: Tensor, *, batch_size: int = 1000,
             device: torch.device | None = None, loader_workers: int | None = None) -> tuple[float, float]:
    """Batched evaluation: (mean loss, accuracy), read from the device once."""
    model.eval()
    device = y.device if device is None else device
    loss = torch.zeros((), device=device)
    correct = torch.zeros((), device=device, dtype=torch.long)
    for xb, yb in batches(x, y, batch_size, None, device, loader_workers):
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
    if flag("trainer.channels_last", trainer.get("channels_last", False)):
        to_channels_last(model)
    rules = OmegaConf.to_container(cfg.hooks, resolve=True) if cfg.get("hooks") else {}
    hooks = attach(model, rules, stage=str(trainer.hook_stage))
    try:
        return _fit(cfg, model, data, hooks, device, batch_size, out, start, loader_workers)
    finally:
        hooks.remove()


def _fit(cfg, model, data, hooks, device, batch_size, out, start, loader_workers=None) -> dict[str, Any]:
    trainer = cfg.trainer
    log.info("%s", hooks.format_plan())
    plan = hooks.describe()
    _write_json(out / "hook_plan.json", plan)
    optimizer = instantiate(cfg.optimizer)(model.parameters())
    # Hooks are attached to `model` already; the compiled module shares its parameters.
    net = compile_model(model) if flag("trainer.compile", trainer.get("compile", False)) else model
    sync_check = SyncCheck(flag("trainer.sync_check", trainer.get("sync_check", False)), device)
    steps_per_epoch = (len(data.train_y) + batch_size - 1) // batch_size
    generator = torch.Generator().manual_seed(int(cfg.seed))
    progress = _progress_enabled(trainer.progress)
    log_every = int(trainer.log_every)
    epochs = int(trainer.epochs)
    history: list[dict[str, Any]] = []
    step = 0
    metrics_file = open(out / "metrics.jsonl", "w")
    stats_file = open(out / "grad_stats.jsonl", "w") if hooks.observers() else None

    last_stats: dict[str, Any] = {}

    def flush_stats(epoch: int) -> dict[str, Any]:
        nonlocal last_stats
        stats = hooks.read_stats()
        if stats and stats_file is not None:
            last_stats = stats
            stats_file.write(json.dumps({"epoch": epoch, "step": step, "stats": stats}) + "\n")
            stats_file.flush()
        return stats

    try:
        for epoch in tqdm(range(1, epochs + 1), desc="epochs", disable=not progress):
            def on_step(i: int) -> None:
                nonlocal step
                step += 1
                if step % log_every == 0:
                    sync_check.allow()
                    flush_stats(epoch)
                # Steps up to the next log point must not sync; the epoch's end reads the loss.
                if i < steps_per_epoch:
                    sync_check.forbid()
                else:
                    sync_check.allow()

            t0 = time.perf_counter()
            train_loss = train_epoch(net, optimizer, data.train_x, data.train_y, batch_size=batch_size,
                                     generator=generator, hooks=hooks, on_step=on_step, progress=progress,
                                     device=device, loader_workers=loader_workers)
            t1 = time.perf_counter()
            test_loss, test_accuracy = evaluate(net, data.test_x, data.test_y, batch_size=int(trainer.eval_batch_size),
                                                device=device, loader_workers=loader_workers)
            t2 = time.perf_counter()
            record = {"epoch": epoch, "step": step, "train_loss": train_loss, "test_loss": test_loss,
                      "test_accuracy": test_accuracy, "seconds": t2 - t0, "train_seconds": t1 - t0,
                      "eval_seconds": t2 - t1}
            # The latest window of `log` statistics: what is pending now, else the last read.
            stats = flush_stats(epoch) or last_stats
            if stats:
                record["grad_stats"] = stats
            metrics_file.write(json.dumps(record) + "\n")
            metrics_file.flush()
            history.append(record)
            log.info("epoch %d/%d  train_loss %.4f  test_loss %.4f  test_accuracy %.4f  (%.1fs)",
                     epoch, epochs, train_loss, test_loss, test_accuracy, t2 - t0)
    finally:
        sync_check.allow()
        metrics_file.close()
        if stats_file is not None:
            stats_file.close()

    torch.save(model.state_dict(), out / "model.pt")
    from gradmod.viz import plot_curves

    plot_curves(history, out / "curves.png")
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
        "seconds": time.perf_counter() - start,
    }
    _write_json(out / "summary.json", summary)
    log.info("test_accuracy %.4f on %s (%d test images) in %.1fs; run folder %s",
             summary["test_accuracy"], data.name, summary["test_size"], summary["seconds"], out)
    return summary
