"""One training run from a typed ``Config``: build, fit, write the run folder.

``execute(config, out)`` reads as its steps: place the process (device, DDP rank, threads,
seed), load the data, build the model (both checked before training: ``setup``), attach the
hook rules, build the Trainer and its callbacks (``assembly``), restore a checkpoint if
asked, fit, and write ``summary.json``. What it built is one ``Run`` (``state``). The run
claims its folder first (lock, no mixing with an earlier run, the resume's config checks:
``gradmod.run.folder.claim`` and ``gradmod.run.resume``) and writes its first byte there only
after the objects are built and the checkpoint restored into them (``_own``): a refused
resume changes nothing. However it ends, its ending is settled once, here, as a value
(``endings.Ending``); ``train`` gives Python callers the summary or raises the error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Collection

import torch
from tqdm.contrib.logging import logging_redirect_tqdm

from gradmod.hooks import stages
from gradmod.hooks.hookset import HookSet, attach
from gradmod.reporting import json_text
from gradmod.reporting.logger_base import Logger
from gradmod.reporting.loggers import check_logger, make_logger
from gradmod.reporting.plan import summarize_plan
from gradmod.run import dp, host_heap, preflight
from gradmod.run.assembly import Parts, build_trainer
from gradmod.run.config import Config
from gradmod.run.folder import atomic, endings
from gradmod.run.folder import checkpoint_file as ckpt
from gradmod.run.folder.claim import Claim, RunFolder
from gradmod.run.folder.curvature_csv import CurvatureFiles
from gradmod.run.folder.scores_csv import ScoresFile
from gradmod.run.folder.writers import GradCamCallback, RunFiles
from gradmod.run.per_sample_paths import PerSamplePaths
from gradmod.run.resume import apply_optimizer, check_epochs, compare
from gradmod.run.setup import build_model, import_plugins, items, load, place
from gradmod.run.state import Run
from gradmod.training.callbacks import EpochLine, SyncCheckCallback
from gradmod.training.curvature import check_rules, split_rules
from gradmod.training.distributed.peers import peer_lost
from gradmod.training.distributed.strategy import Dist, env_rank
from gradmod.training.interrupt import Interrupted, StopOnSignal
from gradmod.training.loader import steps_per_epoch
from gradmod.training.nonfinite import Diverged
from gradmod.training.privacy import PrivacyCallback
from gradmod.training.speed import SyncCheck

log = logging.getLogger(__name__)


def train(cfg: Config, out: str | Path, on_owned: Callable[[Path], None] | None = None) -> dict[str, Any]:
    """Train as ``cfg`` says into the run folder ``out``; returns the summary, or raises the
    error that ended the run (its ``summary.json`` written as ``execute`` says)."""
    return execute(lambda: cfg, out, on_owned).result()


def execute(
    config: Callable[[], Config],
    out: str | Path,
    on_owned: Callable[[Path], None] | None = None,
    asked: Collection[str] | None = None,
) -> endings.Ending:
    """Train as ``config()`` says (the typed config, checked: an error there is the run's
    ending too) and write the run folder ``out``; returns how the run ended.

    The run owns ``out`` (``gradmod.run.folder.claim``) once every check and restore has passed;
    ``on_owned(out)`` then runs before the run's own first write (the command line writes
    ``.hydra/`` and opens ``train.log`` there). Every ending writes ``summary.json``
    (``gradmod.run.folder.endings``); a run refused before owning the folder writes nothing there.
    SIGINT and SIGTERM stop it cleanly from the start (``StopOnSignal``); what it set up is
    undone in reverse order however it ends. ``asked``: the keys the command line sets (a
    resume says a difference outside them in a warning: a default moved; ``gradmod.run.resume``)."""
    t_start = time.perf_counter()
    folder, stop = RunFolder(out), StopOnSignal(folder=Path(out))
    with contextlib.ExitStack() as undo:
        undo.callback(torch.set_num_threads, torch.get_num_threads())  # trainer.threads: this run only
        undo.callback(folder.release)
        undo.enter_context(stop.install())
        try:
            ending = endings.Ending(_fit(_build(config(), folder, stop, t_start, on_owned, undo, asked)))
            _tracked(out, ending.summary)
            return ending
        except BaseException as e:
            if not folder.owned:
                folder.release()  # refused before owning it: settle looks at the folder as others see it
            error = peer_lost(e)  # a rank that died names itself, not the connection it broke
            summary = endings.settle(
                out if env_rank() == 0 else None,
                error,
                time.perf_counter() - t_start,
                owned=folder.owned,
                previous=folder.previous,
            )
            _tracked(out, summary)
            return endings.Ending(summary, error)


def _tracked(out: str | Path, summary: dict[str, Any]) -> None:
    """The ending into the experiment tracker that logged the run (``logger=mlflow``)."""
    from gradmod.reporting import mlflow_tracking

    try:
        mlflow_tracking.finish(out, summary)
    except Exception as e:  # the tracker's server gone: the run's own files hold the ending
        log.warning("logger=mlflow: could not record the ending (%s: %s)", type(e).__name__, e)


def _build(
    cfg: Config,
    folder: RunFolder,
    stop: StopOnSignal,
    t_start: float,
    on_owned: Callable[[Path], None] | None,
    undo: contextlib.ExitStack,
    asked: Collection[str] | None = None,
) -> Run:
    """Everything the run needs before its Trainer, checked, with the folder claimed (no write yet)."""
    import_plugins(cfg.plugins)  # their gradmod.register(...) calls, before any rule is built
    privacy_plan = dp.check(cfg)
    check_logger(dataclasses.asdict(cfg.logger))  # a tracker that cannot take the run: one line, before anything
    dist = place(cfg)
    undo.callback(dist.close)
    claim, diffs = _claim_shared(cfg, folder, dist, asked)
    data, loader_workers = load(cfg, dist)
    model, named_losses = build_model(cfg, data, dist.device)
    if dist.strategy == "fsdp":
        dist.wrap(model)  # fully_shard replaces the parameters (same names): attach to the new ones
    resumed = claim.found[1].get("callbacks", {}).get(PrivacyCallback.key) if claim.found else None
    rules, privacy = dp.prepare(cfg, len(data.train_y), dist.data_size, resumed, privacy_plan)
    rules, curvature = split_rules(rules)  # observers of the loss, not of a gradient: a callback's
    check_rules(curvature, model)
    hooks = _attach(cfg, model, rules, len(data.train_y), dist.data_size, privacy_plan.sampling)
    undo.callback(hooks.remove)
    preflight.check_per_loss(hooks.targets, named_losses, dist.strategy, f"loss._target_={cfg.loss._target_}")
    return Run(
        cfg,
        folder,
        claim,
        dist,
        data,
        model,
        hooks,
        hooks.describe(),
        stop,
        t_start,
        loader_workers=loader_workers,
        privacy=privacy,
        sampling=privacy_plan.sampling,
        diffs=diffs,
        on_owned=on_owned,
        curvature=curvature,
    )


def _attach(cfg: Config, model: Any, rules: Any, train_size: int, data_size: int, sampling: str) -> HookSet:
    """The rules on the model, before DDP wraps it (names without ``module.``), with the run's
    length in optimizer steps (what schedules' and windows' ``ep`` and ``dur`` mean)."""
    t = cfg.trainer
    per_epoch = steps_per_epoch(train_size, cfg.data.batch_size, data_size, t.accumulate, sampling)
    return attach(
        model,
        rules,
        stage=t.hook_stage,
        loss_reduction=cfg.loss.args.get("reduction", "mean"),
        total_steps=per_epoch * t.epochs,
        steps_per_epoch=per_epoch,
    )


def _claim(
    cfg: Config, folder: RunFolder, world_size: int, asked: Collection[str] | None = None
) -> tuple[Claim, dict[str, Any]]:
    """Lock the folder, decide what the run is and check the checkpoint's config (no writes)."""
    t = cfg.trainer
    claim = folder.claim(resume=t.resume, start_over=t.start_over)
    if claim.found is None:
        return claim, {}
    path, state = claim.found
    diffs = compare(state.get("config"), dataclasses.asdict(cfg), t.resume_accept, asked)
    check_epochs(path, state, t.epochs)
    if state.get("world_size", 1) != world_size:  # each rank's share of the data order
        raise ValueError(
            f"trainer.resume: {path} was written by {state.get('world_size', 1)} processes and "
            f"this run has {world_size}; resume with the same number of processes"
        )
    return claim, diffs


def _claim_shared(
    cfg: Config, folder: RunFolder, dist: Dist, asked: Collection[str] | None = None
) -> tuple[Claim, dict[str, Any]]:
    """Rank 0 claims the run folder (the run's folder) and finds the checkpoint; every other
    rank reads the same file from there (a shared file system when ranks span hosts)."""
    if dist.world_size == 1:
        return _claim(cfg, folder, 1, asked)
    if dist.is_main:
        answer = None  # what the other ranks get if the claim raises: rank 0 refused the run
        try:
            claim, diffs = _claim(cfg, folder, dist.world_size, asked)
            answer = (str(claim.found[0].resolve()) if claim.found else None, diffs, claim.run_id)
        finally:
            dist.share(answer)
        return claim, diffs
    answer = dist.share(None)
    if answer is None:
        raise ValueError("rank 0 could not start the run (its error says why)")
    path, diffs, run_id = answer
    return Claim(run_id=run_id, found=(Path(path), ckpt.load(path)) if path else None), diffs


def _fit(run: Run) -> dict[str, Any]:
    log.info("%s", summarize_plan(run.plan, run.cfg.hooks))  # the full plan goes to hook_plan.json
    with contextlib.ExitStack() as stack:
        parts = build_trainer(run)
        if parts.saver.restore_from(parts.trainer, run.claim.found):
            apply_optimizer(parts.trainer.optimizer, run.diffs)  # lr and the like may change on resume
        # Every check and restore has passed: from here the run writes.
        folder = _own(run) if run.dist.is_main else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        _file_callbacks(run, stack, folder, parts)
        if parts.trainer.settings.progress:
            stack.enter_context(logging_redirect_tqdm())  # log lines print above the bar, not through it
        try:
            parts.trainer.fit(run.data, run.cfg.trainer.epochs)
        except (Interrupted, Diverged) as e:  # the epsilon those steps spent is part of the ending
            e.privacy = _privacy(parts.trainer)
            raise
    summary = _summary(run, parts)
    if run.dist.is_main:
        endings.write(run.folder.out, summary)
    log.info(
        "%s on %s (%d test %s) in %.1fs; run folder %s",
        _result_line(summary),
        run.data.name,
        summary["test_size"],
        items(run.data),
        summary["seconds"],
        run.folder.out,
    )
    return summary


def _own(run: Run) -> Path:
    """The run's first writes: the folder's changes (``commit``), the caller's, the hook plan."""
    run.folder.commit(run.claim)
    if run.on_owned is not None:
        run.on_owned(run.folder.out)
    atomic.write_text(run.folder.out / "hook_plan.json", json_text.dumps(run.plan, indent=2) + "\n")
    return run.folder.out


def _file_callbacks(run: Run, stack: contextlib.ExitStack, folder: Path, parts: Parts) -> None:
    """The callbacks that write files or watch the run, after the restored ones, in their
    declared order; what they open closes with ``stack``."""
    logger = (  # rank 0 alone logs: an experiment tracker gets one run, not one per rank
        make_logger(
            dataclasses.asdict(run.cfg.logger), folder, config=dataclasses.asdict(run.cfg), run=run.claim.run_id
        )
        if run.dist.is_main
        else Logger()
    )
    stack.push(_closing(logger.close))
    logger.log_plan(run.plan, run.hooks.format_plan())
    files = RunFiles(folder, logger)
    stack.push(_closing(files.close))
    callbacks = [files, EpochLine(run.cfg.trainer.epochs, run.cfg.trainer.compile)]  # after the record is complete
    callbacks += [GradCamCallback(parts.probe, logger, folder)] if parts.probe is not None else []
    private, scores = run.hooks.stage(stages.counting_examples()), run.hooks.keeping_scores
    callbacks += [PerSamplePaths(folder, run.plan, private)] if private is not None else []
    callbacks += [ScoresFile(folder, scores)] if scores is not None else []
    callbacks += [CurvatureFiles(folder, parts.curvature)] if parts.curvature is not None else []
    sync = SyncCheck(run.cfg.trainer.sync_check, run.dist.device)
    stack.callback(sync.allow)
    run.stop.saver = parts.saver
    parts.trainer.add_callbacks([*callbacks, SyncCheckCallback(sync), run.stop])


def _closing(close: Callable[[], None]) -> Callable[..., bool]:
    """An exit callback that closes files; while another error ends the run (the full disk
    that stopped a write), a failed close is logged and does not replace that error."""

    def exit_(kind, error, tb) -> bool:
        try:
            close()
        except OSError as e:
            if error is None:
                raise
            log.warning("also %s", endings.describe_os_error(e))
        return False

    return exit_


def _summary(run: Run, parts: Parts) -> dict[str, Any]:
    """summary.json: the last epoch's numbers and what the run was."""
    cfg, data, trainer, guard = run.cfg, run.data, parts.trainer, parts.guard
    last = trainer.history[-1]
    privacy = _privacy(trainer)
    return {
        "status": "ok",
        "test_accuracy": last["test_accuracy"],
        "test_loss": last["test_loss"],
        "test_metric": last.get("test_metric"),
        **({"tasks": last["tasks"]} if "tasks" in last else {}),
        "train_loss": last["train_loss"],
        "dataset": data.name,
        "train_size": len(data.train_y),
        "test_size": len(data.test_y),
        "model": cfg.model.name,
        "num_params": sum(p.numel() for p in trainer.model.parameters()),
        "device": str(trainer.device),
        "epochs": len(trainer.history),
        "steps": trainer.step,
        "seed": cfg.seed,
        "world_size": trainer.dist.world_size,
        "threads": torch.get_num_threads(),
        "host_heap": "keep" if host_heap.kept else "release",
        "hook_plan": run.plan,
        "skipped_steps": trainer.skipped,
        "nonfinite_steps": guard.bad_steps,
        "nonfinite": guard.nonfinite,
        "precision": trainer.amp.name,
        "resumed_from": str(trainer.resumed_from) if trainer.resumed_from else None,
        "seconds": parts.saver.seconds(),
        **({"privacy": privacy} if privacy else {}),
        "run": run.claim.run_id,
        "parent": run.claim.parent,
        **({"previous": run.claim.previous} if run.claim.previous is not None else {}),
    }


def _privacy(trainer) -> dict[str, Any] | None:
    """summary.json's privacy block: present only where every step was clipped and noised."""
    accountant = next((cb for cb in trainer.callbacks if isinstance(cb, PrivacyCallback)), None)
    return accountant.summary() if accountant is not None else None


def _result_line(summary: dict[str, Any]) -> str:
    """``test_accuracy 0.9120``, or the loss (and each task's numbers) where there is no accuracy."""
    parts = (
        [f"test_accuracy {summary['test_accuracy']:.4f}"]
        if summary["test_accuracy"] is not None
        else [f"test_loss {summary['test_loss']:.4f}"]
    )
    for name, t in summary.get("tasks", {}).items():
        metric = "" if t["test_metric"] is None else f" {t.get('metric') or 'metric'} {t['test_metric']:.4f}"
        parts.append(f"{name}: loss {t['test_loss']:.4f}{metric}" if t["test_loss"] is not None else f"{name}:{metric}")
    return ", ".join(parts)
