"""One training run from a typed ``Config``: build, fit, write the run folder.

``run(cfg, out)`` reads as its steps: place the process (device, DDP rank, threads, seed),
load the data, build the model, attach the hook rules, build the Trainer and its callbacks,
restore a checkpoint if asked, fit, and write ``summary.json``. Before any of it the run
claims its folder (lock, no mixing with an earlier run, resume checks: see ``run_folder``
and ``resume_check``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import logging
import random
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from tqdm.contrib.logging import logging_redirect_tqdm

from gradmod.data import Data
from gradmod.hooks.rules import HookSet, attach
from gradmod.reporting.loggers import make_logger
from gradmod.reporting.observe import GradCamProbe
from gradmod.reporting.plan import summarize_plan
from gradmod.reporting.sweep_report import failed_summary
from gradmod.run import checkpoint_file as ckpt
from gradmod.run.checkpointing import Checkpointer
from gradmod.run.config import Config
from gradmod.run.factories import build_data, build_loss, build_optimizer, build_scheduler, model_factory, param_groups
from gradmod.run.files import GradCamCallback, RunFiles
from gradmod.run.folder import RunFolder, has_results, replace_text
from gradmod.run.resume import apply_optimizer, compare
from gradmod.training.callbacks import NonFiniteCallback, SyncCheckCallback
from gradmod.training.distributed import Dist
from gradmod.training.interrupt import Interrupted, StopOnSignal
from gradmod.training.loader import batches_per_epoch, placement, steps_per_epoch
from gradmod.training.nonfinite import NonFiniteGuard
from gradmod.training.precision import Precision, check_precision
from gradmod.training.schedule import SchedulerCallback
from gradmod.training.speed import SyncCheck, compile_model, to_channels_last
from gradmod.training.trainer import Trainer, TrainerSettings
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
    if device.type not in ("cpu", "cuda") or (device.type == "cpu" and device.index is not None):
        raise ValueError(f"trainer.device={name!r} is not supported; allowed: auto, cpu, cuda, cuda:N")
    return device


def import_plugins(modules: list[str]) -> None:
    """Import the user's modules named in ``plugins`` (from the current folder, PYTHONPATH or installed)."""
    cwd = str(Path.cwd())
    if modules and cwd not in sys.path:
        sys.path.append(cwd)  # python train.py puts train.py's folder first, not the user's
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise ValueError(f"plugins: cannot import {name!r} ({e}); a plugin is a module importable from "
                             "the current folder, PYTHONPATH or an installed package, e.g. my_pkg.transforms") from None


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def run(cfg: Config, out: str | Path) -> dict[str, Any]:
    """Train as ``cfg`` says and write the run folder ``out``; returns the summary.

    The run owns ``out`` (``gradmod.run.folder``) from the checks on: every ending
    after that writes ``summary.json`` (ok, failed, interrupted); a run refused before
    writes nothing there."""
    t_start = time.perf_counter()
    threads = torch.get_num_threads()  # trainer.threads holds for this run only (in-process sweeps)
    folder = RunFolder(out)
    try:
        import_plugins(cfg.plugins)  # their transforms.register(...) calls, before any rule is built
        dist = _place(cfg)
        try:
            resume = _claim(cfg, folder) if dist.is_main else (None, {})
            data, loader_workers = _load(cfg, dist.device)
            _warn_sizes(cfg, data, dist.world_size)
            model = _model(cfg, data, dist.device)
            hooks = attach(model, cfg.hooks, stage=cfg.trainer.hook_stage)  # before DDP: names without "module."
            try:
                return _fit(cfg, model, data, hooks, dist, loader_workers, folder, resume, t_start)
            finally:
                hooks.remove()
        except BaseException as e:
            if folder.owned:
                _write_ending(folder.out, e, time.perf_counter() - t_start)
            raise
        finally:
            dist.close()
            folder.release()
    finally:
        torch.set_num_threads(threads)


def _claim(cfg: Config, folder: RunFolder) -> tuple[Any, dict[str, Any]]:
    """Lock the folder, find the checkpoint to resume and check its config; only then own it."""
    t = cfg.trainer
    run_id = folder.claim(resume=t.resume, start_over=t.start_over)
    found = ckpt.find(t.resume, folder.out / "checkpoints", folder.resume_run)
    diffs = compare(found[1].get("config"), dataclasses.asdict(cfg), t.resume_accept) if found else {}
    if found is None and t.resume is not None and has_results(folder.out):
        log.warning("trainer.resume=%s found nothing to resume in %s; its earlier results are replaced",
                    t.resume, folder.out)
        folder.remove_outputs()
    folder.take_ownership(run_id)
    return found, diffs


def _write_ending(out: Path, error: BaseException, seconds: float) -> None:
    """summary.json for a run that raised: failed (with the one-line error) or interrupted."""
    summary = failed_summary(None, error, seconds)
    if isinstance(error, Interrupted):
        summary.update(status="interrupted", error=str(error), signal=signal.Signals(error.signum).name,
                       steps=error.step, checkpoint=str(error.checkpoint) if error.checkpoint else None)
    elif isinstance(error, OSError):
        summary["error"] = describe_os_error(error)
    with contextlib.suppress(OSError):  # a full disk or a lost folder: the error itself says so
        _write_json(out / "summary.json", summary)
    error.gradmod_summary = summary  # the command line writes none of its own


def describe_os_error(e: OSError) -> str:
    """One line for a failed file operation, naming the path."""
    where = f" {e.filename}" if e.filename else ""
    return f"cannot write{where}: {e.strerror or e}"


def _warn_sizes(cfg: Config, data: Data, world_size: int) -> None:
    """Sizes that train, but not as the user probably meant."""
    n, bs = len(data.train_y), cfg.data.batch_size
    if bs > n:
        log.warning("data.batch_size=%d is larger than the training set (%d images): each epoch is one batch of %d",
                    bs, n, n)
    per_epoch = batches_per_epoch(n, bs, world_size)
    if cfg.trainer.accumulate > per_epoch:
        log.warning("trainer.accumulate=%d is more than the %d batches of an epoch: each epoch is one optimizer "
                    "step over %d batches", cfg.trainer.accumulate, per_epoch, per_epoch)


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
         run_folder: RunFolder, resume: tuple[Any, dict[str, Any]], t_start: float) -> dict[str, Any]:
    t, out = cfg.trainer, run_folder.out
    plan = hooks.describe()
    log.info("%s", summarize_plan(plan, cfg.hooks))  # the full plan goes to hook_plan.json
    if dist.is_main:  # rank 0 alone writes the run folder
        _write_json(out / "hook_plan.json", plan)
    wrapped = dist.wrap(model)
    # Hooks are attached to the plain model already; the compiled module shares its parameters.
    net = compile_model(wrapped) if t.compile else wrapped
    guard = NonFiniteGuard(model, hooks, t.nonfinite, world_sum=_world_sum if dist.world_size > 1 else None)
    optimizer = build_optimizer(cfg.optimizer, param_groups(model.named_parameters(), cfg.optimizer.no_decay),
                                dist.device)
    with contextlib.ExitStack() as stack:
        folder = out if dist.is_main else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        callbacks, saver, stop = _callbacks(cfg, stack, folder, run_folder, data, hooks, plan, guard, optimizer, dist)
        settings = TrainerSettings(batch_size=cfg.data.batch_size, accumulate=t.accumulate,
                                   eval_batch_size=t.eval_batch_size, log_every=t.log_every,
                                   progress=t.progress and _stderr_is_terminal(), loader_workers=loader_workers)
        trainer = Trainer(model, optimizer, settings, hooks=hooks, amp=Precision(t.precision, dist.device),
                          loss_fn=build_loss(cfg.loss), callbacks=callbacks, dist=dist, net=net,
                          eval_net=model if net is wrapped else net, generator=torch.Generator().manual_seed(cfg.seed))
        found, diffs = resume
        if saver.restore_from(trainer, found):
            apply_optimizer(trainer.optimizer, diffs)  # lr and the like may change on resume
        if settings.progress:
            stack.enter_context(logging_redirect_tqdm())  # log lines print above the bar, not through it
        with stop.install():
            trainer.fit(data, t.epochs)
    summary = _summary(cfg, data, trainer, guard, plan, time.perf_counter() - t_start)
    if dist.is_main:
        _write_json(out / "summary.json", summary)
    log.info("test_accuracy %.4f on %s (%d test images) in %.1fs; run folder %s",
             summary["test_accuracy"], data.name, summary["test_size"], summary["seconds"], out)
    return summary


def _callbacks(cfg: Config, stack: contextlib.ExitStack, folder: Path, run_folder: RunFolder, data: Data,
               hooks: HookSet, plan: Any, guard: NonFiniteGuard, optimizer: torch.optim.Optimizer,
               dist: Dist) -> tuple[list[Any], Checkpointer, StopOnSignal]:
    """The run's callbacks in the order they must run; what they open closes with ``stack``."""
    t = cfg.trainer
    logger = make_logger(dataclasses.asdict(cfg.logger), folder)
    stack.callback(logger.close)
    logger.log_plan(plan, hooks.format_plan())
    files = RunFiles(folder, logger)
    stack.callback(files.close)
    saver = Checkpointer(run_folder.out / "checkpoints", every_epochs=t.checkpoint_every,
                         every_steps=t.checkpoint_every_steps, keep=t.checkpoint_keep, epochs=t.epochs,
                         config=dataclasses.asdict(cfg), plan=plan, writes=dist.is_main, run=run_folder.run_id)
    steps = steps_per_epoch(len(data.train_y), cfg.data.batch_size, dist.world_size, t.accumulate)
    schedule = SchedulerCallback(build_scheduler(cfg.scheduler, optimizer, steps * t.epochs))
    callbacks = [NonFiniteCallback(guard), schedule, saver, files]  # schedule before saver: see SchedulerCallback
    if cfg.capture.gradcam:
        probe = GradCamProbe(model_factory(cfg.model, data), data, cfg.capture.gradcam_layer,
                             cfg.capture.gradcam_images, dist.device)
        callbacks.append(GradCamCallback(probe, logger, folder))
    sync = SyncCheck(t.sync_check, dist.device)
    stack.callback(sync.allow)
    callbacks.append(SyncCheckCallback(sync))  # last but one: see SyncCheckCallback
    stop = StopOnSignal(saver)
    callbacks.append(stop)  # last: the step's other callbacks are done when it stops the run
    return callbacks, saver, stop


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
    return sys.stderr.isatty()


def _write_json(path: Path, obj: Any) -> None:
    replace_text(path, json.dumps(obj, indent=2) + "\n")


def _world_sum(t: Tensor) -> Tensor:
    torch.distributed.all_reduce(t)
    return t
