"""One training run from a typed ``Config``: build, fit, write the run folder.

``run(cfg, out)`` reads as its steps: place the process (device, DDP rank, threads, seed),
load the data, build the model, attach the hook rules, build the Trainer and its callbacks,
restore a checkpoint if asked, fit, and write ``summary.json``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from gradmod.data import Data
from gradmod.hooks.rules import HookSet, attach
from gradmod.reporting.loggers import make_logger
from gradmod.reporting.observe import GradCamProbe
from gradmod.training.build import build_optimizer, param_groups
from gradmod.training.callbacks import NonFiniteCallback, SyncCheckCallback
from gradmod.training.checkpointer import Checkpointer
from gradmod.training.config import Config
from gradmod.training.distributed import Dist
from gradmod.training.loader import placement
from gradmod.training.loop import batches_per_epoch
from gradmod.training.nonfinite import NonFiniteGuard
from gradmod.training.precision import Precision, check_precision
from gradmod.training.run_files import GradCamCallback, RunFiles
from gradmod.training.schedule import SchedulerCallback, build_scheduler
from gradmod.training.speed import SyncCheck, compile_model, to_channels_last
from gradmod.training.targets import build_data, build_loss, model_factory
from gradmod.training.trainer import Trainer
from gradmod.weight_init import apply_init

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


def run(cfg: Config, out: str | Path) -> dict[str, Any]:
    """Train as ``cfg`` says and write the run folder ``out``; returns the summary."""
    t_start = time.perf_counter()
    threads = torch.get_num_threads()  # trainer.threads holds for this run only (in-process sweeps)
    try:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        dist = _place(cfg)
        data, loader_workers = _load(cfg, dist.device)
        model = _model(cfg, data, dist.device)
        hooks = attach(model, cfg.hooks, stage=cfg.trainer.hook_stage)  # before DDP: names without "module."
        try:
            return _fit(cfg, model, data, hooks, dist, loader_workers, out, t_start)
        finally:
            hooks.remove()
            dist.close()
    finally:
        torch.set_num_threads(threads)


def _place(cfg: Config) -> Dist:
    """This process's device and rank, threads and seeds."""
    dist = Dist.from_env(cfg.trainer.strategy, resolve_device(cfg.trainer.device))
    check_precision(cfg.trainer.precision, dist.device)
    if dist.world_size > 1 and cfg.trainer.resume:
        raise ValueError("trainer.resume with trainer.strategy=ddp is not supported yet (ranks > 0 have no "
                         "run folder to find checkpoints in); resume with strategy=single")
    if cfg.trainer.threads:
        torch.set_num_threads(cfg.trainer.threads)
    seed_everything(cfg.seed)
    return dist


def _load(cfg: Config, device: torch.device) -> tuple[Data, int | None]:
    """The dataset, on the device when it fits (else a DataLoader's worker count)."""
    data = build_data(cfg.data, data_dir=cfg.data_dir, seed=cfg.seed)
    if placement(cfg.trainer.data_placement, data, device) == "device":
        return data.to(device), None  # batches indexed on the device
    return data, cfg.trainer.loader_workers


def _model(cfg: Config, data: Data, device: torch.device) -> nn.Module:
    model = model_factory(cfg.model, data)()
    apply_init(model, cfg.init.name)
    model.to(device)
    if cfg.trainer.channels_last:
        to_channels_last(model)  # same Parameter objects: attach before or after is the same
    return model


def _fit(cfg: Config, model: nn.Module, data: Data, hooks: HookSet, dist: Dist, loader_workers: int | None,
         out: Path, t_start: float) -> dict[str, Any]:
    t = cfg.trainer
    log.info("%s", hooks.format_plan())
    plan = hooks.describe()
    if dist.is_main:  # rank 0 alone writes the run folder
        _write_json(out / "hook_plan.json", plan)
    wrapped = dist.wrap(model)
    # Hooks are attached to the plain model already; the compiled module shares its parameters.
    net = compile_model(wrapped) if t.compile else wrapped
    amp = Precision(t.precision, dist.device)
    guard = NonFiniteGuard(model, hooks, t.nonfinite, world_sum=_world_sum if dist.world_size > 1 else None)
    sync = SyncCheck(t.sync_check, dist.device)
    with contextlib.ExitStack() as stack:
        folder = out if dist.is_main else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        logger = make_logger(dataclasses.asdict(cfg.logger), folder)
        stack.callback(logger.close)
        logger.log_plan(plan, hooks.format_plan())
        files = RunFiles(folder, logger)
        stack.callback(files.close)
        saver = Checkpointer(out / "checkpoints", every_epochs=t.checkpoint_every, every_steps=t.checkpoint_every_steps,
                             keep=t.checkpoint_keep, epochs=t.epochs, config=dataclasses.asdict(cfg), plan=plan,
                             writes=dist.is_main)
        optimizer = build_optimizer(cfg.optimizer, param_groups(model.named_parameters(), cfg.optimizer.no_decay),
                                    dist.device)
        steps = -(-batches_per_epoch(len(data.train_y), cfg.data.batch_size, dist.world_size) // t.accumulate)
        schedule = SchedulerCallback(build_scheduler(cfg.scheduler, optimizer, steps * t.epochs))
        callbacks = [NonFiniteCallback(guard), schedule, saver, files]  # schedule before saver: see SchedulerCallback
        if cfg.capture.gradcam:
            probe = GradCamProbe(model_factory(cfg.model, data), data, cfg.capture.gradcam_layer,
                                 cfg.capture.gradcam_images, dist.device)
            callbacks.append(GradCamCallback(probe, logger, folder))
        callbacks.append(SyncCheckCallback(sync))  # last: see SyncCheckCallback
        stack.callback(sync.allow)
        trainer = Trainer(model, optimizer, hooks=hooks, amp=amp, loss_fn=build_loss(cfg.loss),
                          callbacks=callbacks, dist=dist, net=net, eval_net=model if net is wrapped else net,
                          accumulate=t.accumulate, batch_size=cfg.data.batch_size,
                          eval_batch_size=t.eval_batch_size, log_every=t.log_every,
                          progress=t.progress and _stderr_is_terminal(), loader_workers=loader_workers,
                          generator=torch.Generator().manual_seed(cfg.seed))
        saver.restore(trainer, t.resume)
        trainer.fit(data, t.epochs)
    summary = _summary(cfg, data, trainer, guard, plan, time.perf_counter() - t_start)
    if dist.is_main:
        _write_json(out / "summary.json", summary)
    log.info("test_accuracy %.4f on %s (%d test images) in %.1fs; run folder %s",
             summary["test_accuracy"], data.name, summary["test_size"], summary["seconds"], out)
    return summary


def _summary(cfg: Config, data: Data, trainer: Trainer, guard: NonFiniteGuard, plan: Any,
             seconds: float) -> dict[str, Any]:
    """summary.json: the last epoch's numbers and what the run was."""
    last = trainer.history[-1]
    return {
        "status": "ok", "test_accuracy": last["test_accuracy"], "test_loss": last["test_loss"],
        "train_loss": last["train_loss"], "dataset": data.name, "train_size": len(data.train_y),
        "test_size": len(data.test_y), "model": cfg.model.name,
        "num_params": sum(p.numel() for p in trainer.model.parameters()), "device": str(trainer.device),
        "epochs": len(trainer.history), "steps": trainer.step, "seed": cfg.seed,
        "world_size": trainer.dist.world_size, "threads": torch.get_num_threads(), "hook_plan": plan,
        "skipped_steps": trainer.skipped, "nonfinite_steps": guard.bad_steps, "nonfinite": guard.nonfinite,
        "precision": trainer.amp.name,
        "resumed_from": str(trainer.resumed_from) if trainer.resumed_from else None, "seconds": seconds,
    }


def _stderr_is_terminal() -> bool:
    import sys

    return sys.stderr.isatty()


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    tmp.replace(path)


def _world_sum(t: Tensor) -> Tensor:
    torch.distributed.all_reduce(t)
    return t
