"""One training run from a typed ``Config``: build, fit, write the run folder.

``train(cfg, out)`` reads as its steps: place the process (device, DDP rank, threads, seed),
load the data, build the model (both checked before training: ``preflight``), attach the
hook rules, build the Trainer and its callbacks, restore a checkpoint if asked, fit, and
write ``summary.json``. The run claims its folder first (lock, no mixing with an earlier
run, the resume's config checks: ``gradmod.run.folder`` and ``gradmod.run.resume``) and
writes its first byte there only after the objects are built and the checkpoint restored
into them (``_own``): a refused resume changes nothing. However it ends, ``endings``
writes what happened.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import logging
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch import Tensor, nn
from tqdm.contrib.logging import logging_redirect_tqdm

from gradmod.data import Data
from gradmod.hooks.hookset import HookSet, attach
from gradmod.reporting import json_text
from gradmod.reporting.loggers import make_logger
from gradmod.reporting.observe import GradCamProbe
from gradmod.reporting.plan import summarize_plan
from gradmod.run import atomic, dp, endings, preflight
from gradmod.run import checkpoint_file as ckpt
from gradmod.run.checkpointing import Checkpointer
from gradmod.run.config import Config
from gradmod.run.factories import (
    build_data,
    build_optimizer,
    build_scheduler,
    build_tasks,
    describe_groups,
    model_factory,
    param_groups,
)
from gradmod.run.files import GradCamCallback, RunFiles
from gradmod.run.folder import Claim, RunFolder
from gradmod.run.resume import apply_optimizer, check_epochs, compare
from gradmod.training.callbacks import NonFiniteCallback, SyncCheckCallback
from gradmod.training.distributed import Dist, env_rank
from gradmod.training.divergence import DivergenceCallback
from gradmod.training.interrupt import Interrupted, StopOnSignal
from gradmod.training.loader import batches_per_epoch, placement, steps_per_epoch
from gradmod.training.nonfinite import Diverged, NonFiniteGuard
from gradmod.training.precision import Precision, check_precision
from gradmod.training.privacy import PrivacyCallback
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
        except Exception as e:  # the plugin's own code failed (a SyntaxError names its line itself)
            where = "" if isinstance(e, SyntaxError) else f" at {endings.user_frame(e) or 'import'}"
            raise ValueError(f"plugins: importing {name!r} raised {type(e).__name__}{where}: "
                             f"{endings.one_line(str(e))}") from None


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def train(cfg: Config, out: str | Path, on_owned: Callable[[Path], None] | None = None) -> dict[str, Any]:
    """Train as ``cfg`` says and write the run folder ``out``; returns the summary.

    The run owns ``out`` (``gradmod.run.folder``) once every check and restore has passed;
    ``on_owned(out)`` then runs before the run's own first write (the command line writes
    ``.hydra/`` and opens ``train.log`` there). Every ending writes ``summary.json``
    (``gradmod.run.endings``); a run refused before owning the folder writes nothing there.
    SIGINT and SIGTERM stop it cleanly from the start (``StopOnSignal``); what it set up is
    undone in reverse order however it ends."""
    t_start = time.perf_counter()
    folder, stop = RunFolder(out), StopOnSignal()
    with contextlib.ExitStack() as undo:
        undo.callback(torch.set_num_threads, torch.get_num_threads())  # trainer.threads: this run only
        undo.callback(folder.release)
        undo.enter_context(stop.install())
        try:
            import_plugins(cfg.plugins)  # their transforms.register(...) calls, before any rule is built
            dp.check(cfg)
            dist = _place(cfg)
            undo.callback(dist.close)
            claimed = _claim_shared(cfg, folder, dist)
            data, loader_workers = _load(cfg, dist)
            model, several = _model(cfg, data, dist.device)
            if dist.strategy == "fsdp":
                dist.wrap(model)  # fully_shard replaces the parameters (same names): attach to the new ones
            rules, privacy = dp.prepare(cfg, len(data.train_y), dist.world_size)
            hooks = attach(model, rules, stage=cfg.trainer.hook_stage,  # before DDP: names without "module."
                           loss_reduction=cfg.loss.args.get("reduction", "mean"))
            undo.callback(hooks.remove)
            preflight.check_per_loss(hooks.targets, several, dist.strategy, f"loss._target_={cfg.loss._target_}")
            return _fit(cfg, model, data, hooks, dist, loader_workers, folder, claimed, stop, t_start, on_owned,
                        privacy)
        except BaseException as e:
            if not folder.owned:
                folder.release()  # refused before owning it: settle looks at the folder as others see it
            endings.settle(out if env_rank() == 0 else None, e, time.perf_counter() - t_start, owned=folder.owned)
            raise


def _claim(cfg: Config, folder: RunFolder, world_size: int) -> tuple[Claim, dict[str, Any]]:
    """Lock the folder, decide what the run is and check the checkpoint's config (no writes)."""
    t = cfg.trainer
    claim = folder.claim(resume=t.resume, start_over=t.start_over)
    if claim.found is None:
        return claim, {}
    path, state = claim.found
    diffs = compare(state.get("config"), dataclasses.asdict(cfg), t.resume_accept)
    check_epochs(path, state, t.epochs)
    if state.get("world_size", 1) != world_size:  # each rank's share of the data order
        raise ValueError(f"trainer.resume: {path} was written by {state.get('world_size', 1)} processes and "
                         f"this run has {world_size}; resume with the same number of processes")
    return claim, diffs


def _claim_shared(cfg: Config, folder: RunFolder, dist: Dist) -> tuple[Claim, dict[str, Any]]:
    """Rank 0 claims the run folder (the run's folder) and finds the checkpoint; every other
    rank reads the same file from there (a shared file system when ranks span hosts)."""
    if dist.world_size == 1:
        return _claim(cfg, folder, 1)
    if dist.is_main:
        answer = None  # what the other ranks get if the claim raises: rank 0 refused the run
        try:
            claim, diffs = _claim(cfg, folder, dist.world_size)
            answer = (str(claim.found[0].resolve()) if claim.found else None, diffs, claim.run_id)
        finally:
            dist.share(answer)
        return claim, diffs
    answer = dist.share(None)
    if answer is None:
        raise ValueError("rank 0 could not start the run (its error says why)")
    path, diffs, run_id = answer
    return Claim(run_id=run_id, found=(Path(path), ckpt.load(path)) if path else None), diffs


def _warn_sizes(cfg: Config, data: Data, world_size: int) -> None:
    """Sizes that train, but not as the user probably meant."""
    n, bs = len(data.train_y), cfg.data.batch_size
    if bs > n:
        log.warning("data.batch_size=%d is larger than the training set (%d %s): each epoch is one batch of %d",
                    bs, n, _items(data), n)
    per_epoch = batches_per_epoch(n, bs, world_size)
    if cfg.trainer.accumulate > per_epoch:
        log.warning("trainer.accumulate=%d is more than the %d batches of an epoch: each epoch is one optimizer "
                    "step over %d batches", cfg.trainer.accumulate, per_epoch, per_epoch)


def _place(cfg: Config) -> Dist:
    """This process's device and rank, threads and seeds."""
    dist = Dist.from_env(cfg.trainer.strategy, resolve_device(cfg.trainer.device))
    check_precision(cfg.trainer.precision, dist.device)
    if dist.strategy == "fsdp" and cfg.capture.gradcam:  # the probe copies the whole model's weights
        raise ValueError("capture.gradcam=true with trainer.strategy=fsdp is not supported; use trainer.strategy=ddp")
    dist.start()
    if cfg.trainer.threads:
        torch.set_num_threads(cfg.trainer.threads)
    seed_everything(cfg.seed)
    return dist


def _load(cfg: Config, dist: Dist) -> tuple[Data, int | None]:
    """The checked dataset, on the device when it fits (else a DataLoader's worker count)."""
    data = build_data(cfg.data, data_dir=cfg.data_dir, seed=cfg.seed)
    preflight.check_data(data, None if cfg.model._target_ else f"model.name={cfg.model.name}")
    _warn_sizes(cfg, data, dist.world_size)
    if placement(cfg.trainer.data_placement, data, dist.device) == "device":
        return data.to(dist.device), None  # batches indexed on the device
    return data, cfg.trainer.loader_workers


def _model(cfg: Config, data: Data, device: torch.device) -> tuple[nn.Module, bool]:
    """The model on ``device``, checked with the loss and metric on two training examples
    (before any hook); and whether the loss is several named losses."""
    model = model_factory(cfg.model, data)()
    apply_init(model, cfg.init.name)
    model.to(device)
    if cfg.trainer.channels_last:
        to_channels_last(model)  # same Parameter objects: attach before or after is the same
    key = f"model._target_={cfg.model._target_}" if cfg.model._target_ else f"model.name={cfg.model.name}"
    several, metrics = preflight.check_model(model, data, build_tasks(cfg.loss, cfg.metric), key,
                                             f"loss._target_={cfg.loss._target_}")
    if several or not metrics.endswith("accuracy"):
        log.info("%s", metrics)  # the classification default goes without saying
    return model, several


def _fit(cfg: Config, model: nn.Module, data: Data, hooks: HookSet, dist: Dist, loader_workers: int | None,
         run_folder: RunFolder, claimed: tuple[Claim, dict[str, Any]], stop: StopOnSignal, t_start: float,
         on_owned: Callable[[Path], None] | None, privacy: dp.Privacy | None) -> dict[str, Any]:
    claim, diffs = claimed
    plan = hooks.describe()
    log.info("%s", summarize_plan(plan, cfg.hooks))  # the full plan goes to hook_plan.json
    with contextlib.ExitStack() as stack:
        trainer, saver, guard, probe = _trainer(cfg, model, data, hooks, dist, loader_workers, claim.run_id, plan,
                                                t_start, run_folder.out / "checkpoints", privacy)
        if saver.restore_from(trainer, claim.found):
            apply_optimizer(trainer.optimizer, diffs)  # lr and the like may change on resume
        # Every check and restore has passed: from here the run writes.
        folder = _own(run_folder, claim, on_owned, plan) if dist.is_main else \
            Path(stack.enter_context(tempfile.TemporaryDirectory()))
        _file_callbacks(cfg, stack, folder, trainer, saver, plan, probe, dist, stop)
        if trainer.settings.progress:
            stack.enter_context(logging_redirect_tqdm())  # log lines print above the bar, not through it
        try:
            trainer.fit(data, cfg.trainer.epochs)
        except (Interrupted, Diverged) as e:  # the epsilon those steps spent is part of the ending
            e.privacy = _privacy(trainer)
            raise
    summary = _summary(cfg, data, trainer, guard, plan, saver.seconds())
    summary.update(run=claim.run_id, parent=claim.parent)
    if dist.is_main:
        endings.write(run_folder.out, summary)
    log.info("%s on %s (%d test %s) in %.1fs; run folder %s", _result_line(summary),
             data.name, summary["test_size"], _items(data), summary["seconds"], run_folder.out)
    return summary


def _trainer(cfg: Config, model: nn.Module, data: Data, hooks: HookSet, dist: Dist, loader_workers: int | None,
             run_id: str, plan: Any, t_start: float, checkpoints: Path,
             privacy: dp.Privacy | None) -> tuple[Trainer, Checkpointer, NonFiniteGuard, GradCamProbe | None]:
    """The Trainer with the callbacks a checkpoint restores (nothing here writes a file)."""
    t = cfg.trainer
    wrapped = dist.wrap(model)
    # Hooks are attached to the plain model already; the compiled module shares its parameters.
    net = compile_model(wrapped) if t.compile else wrapped
    many = dist.world_size > 1
    guard = NonFiniteGuard(model, hooks, t.nonfinite, world_sum=_world_sum if many else None,
                           sharded=many and dist.strategy == "fsdp")
    groups = param_groups(model.named_parameters(), cfg.optimizer.no_decay)
    if cfg.optimizer.no_decay:
        log.info("%s", describe_groups(model, groups, cfg.optimizer.weight_decay))
    optimizer = build_optimizer(cfg.optimizer, groups, dist.device)
    saver = Checkpointer(checkpoints, every_epochs=t.checkpoint_every, every_steps=t.checkpoint_every_steps,
                         keep=t.checkpoint_keep, epochs=t.epochs, config=dataclasses.asdict(cfg), plan=plan,
                         writes=dist.is_main, run=run_id, started=t_start)
    steps = steps_per_epoch(len(data.train_y), cfg.data.batch_size, dist.world_size, t.accumulate, dp.sampling(cfg))
    schedule = SchedulerCallback(build_scheduler(cfg.scheduler, optimizer, steps * t.epochs))
    diverged = DivergenceCallback(p for group in optimizer.param_groups for p in group["params"])
    # divergence before saver and files: a diverged epoch leaves no checkpoint or metrics line;
    # schedule before saver: see SchedulerCallback
    callbacks = [NonFiniteCallback(guard), diverged, schedule, saver]
    if privacy is not None:  # before saver (its state in the step's checkpoint) and files (epsilon in the record)
        callbacks.insert(callbacks.index(saver), PrivacyCallback(
            cfg.privacy.accountant, cfg.privacy.delta, privacy.noise_multiplier, privacy.sample_rate,
            sampling=dp.sampling(cfg), target_epsilon=cfg.privacy.target_epsilon, clip=hooks.per_sample.noisy))
    # Grad-CAM's copy of the model is built now: after the restore it would draw from the restored RNG.
    probe = GradCamProbe(model_factory(cfg.model, data), data, cfg.capture.gradcam_layer,
                         cfg.capture.gradcam_images, dist.device) if cfg.capture.gradcam else None
    settings = TrainerSettings(batch_size=cfg.data.batch_size, accumulate=t.accumulate,
                               eval_batch_size=t.eval_batch_size, log_every=t.log_every,
                               progress=t.progress and _stderr_is_terminal(), loader_workers=loader_workers,
                               sampling=dp.sampling(cfg))
    trainer = Trainer(model, optimizer, settings, hooks=hooks, amp=Precision(t.precision, dist.device),
                      tasks=build_tasks(cfg.loss, cfg.metric), callbacks=callbacks, dist=dist, net=net,
                      eval_net=model if net is wrapped else net, generator=torch.Generator().manual_seed(cfg.seed))
    return trainer, saver, guard, probe


def _own(run_folder: RunFolder, claim: Claim, on_owned: Callable[[Path], None] | None, plan: Any) -> Path:
    """The run's first writes: the folder's changes (``commit``), the caller's, the hook plan."""
    run_folder.commit(claim)
    if on_owned is not None:
        on_owned(run_folder.out)
    _write_json(run_folder.out / "hook_plan.json", plan)
    return run_folder.out


def _file_callbacks(cfg: Config, stack: contextlib.ExitStack, folder: Path, trainer: Trainer, saver: Checkpointer,
                    plan: Any, probe: GradCamProbe | None, dist: Dist, stop: StopOnSignal) -> None:
    """The callbacks that write files or watch the run, after the restored ones in the order
    they must run; what they open closes with ``stack``."""
    logger = make_logger(dataclasses.asdict(cfg.logger), folder)
    stack.callback(logger.close)
    logger.log_plan(plan, trainer.hooks.format_plan())
    files = RunFiles(folder, logger)
    stack.callback(files.close)
    callbacks = [files] + ([GradCamCallback(probe, logger, folder)] if probe is not None else [])
    sync = SyncCheck(cfg.trainer.sync_check, dist.device)
    stack.callback(sync.allow)
    callbacks.append(SyncCheckCallback(sync))  # last but one: see SyncCheckCallback
    stop.saver = saver
    callbacks.append(stop)  # last: the step's other callbacks are done when it stops the run
    trainer.callbacks.extend(callbacks)


def _summary(cfg: Config, data: Data, trainer: Trainer, guard: NonFiniteGuard, plan: Any,
             seconds: float) -> dict[str, Any]:
    """summary.json: the last epoch's numbers and what the run was."""
    last = trainer.history[-1]
    privacy = _privacy(trainer)
    return {
        "status": "ok", "test_accuracy": last["test_accuracy"], "test_loss": last["test_loss"],
        "test_metric": last.get("test_metric"), **({"tasks": last["tasks"]} if "tasks" in last else {}),
        "train_loss": last["train_loss"], "dataset": data.name, "train_size": len(data.train_y),
        "test_size": len(data.test_y), "model": cfg.model.name,
        "num_params": sum(p.numel() for p in trainer.model.parameters()), "device": str(trainer.device),
        "epochs": len(trainer.history), "steps": trainer.step, "seed": cfg.seed,
        "world_size": trainer.dist.world_size, "threads": torch.get_num_threads(), "hook_plan": plan,
        "skipped_steps": trainer.skipped, "nonfinite_steps": guard.bad_steps, "nonfinite": guard.nonfinite,
        "precision": trainer.amp.name,
        "resumed_from": str(trainer.resumed_from) if trainer.resumed_from else None, "seconds": seconds,
        **({"privacy": privacy} if privacy else {}),
    }


def _privacy(trainer: Trainer) -> dict[str, Any] | None:
    """summary.json's privacy block: present only where every step was clipped and noised."""
    accountant = next((cb for cb in trainer.callbacks if isinstance(cb, PrivacyCallback)), None)
    return accountant.summary() if accountant is not None else None


def _result_line(summary: dict[str, Any]) -> str:
    """``test_accuracy 0.9120``, or the loss (and each task's numbers) where there is no accuracy."""
    parts = [f"test_accuracy {summary['test_accuracy']:.4f}"] if summary["test_accuracy"] is not None else \
        [f"test_loss {summary['test_loss']:.4f}"]
    for name, t in summary.get("tasks", {}).items():
        metric = "" if t["test_metric"] is None else f" metric {t['test_metric']:.4f}"
        parts.append(f"{name}: loss {t['test_loss']:.4f}{metric}" if t["test_loss"] is not None else f"{name}:{metric}")
    return ", ".join(parts)


def _items(data: Data) -> str:
    """What the dataset holds, for log lines: images (N x C x H x W) or examples."""
    return "images" if data.test_x.ndim == 4 else "examples"


def _stderr_is_terminal() -> bool:
    return sys.stderr.isatty()


def _write_json(path: Path, obj: Any) -> None:
    atomic.write_text(path, json_text.dumps(obj, indent=2) + "\n")


def _world_sum(t: Tensor) -> Tensor:
    torch.distributed.all_reduce(t)
    return t
