"""A run's Trainer with the callbacks a checkpoint restores, in their declared order
(``gradmod.training.callbacks.check_order``); nothing here writes a file."""

from __future__ import annotations

import dataclasses
import logging
import sys
from typing import Any

import torch
from torch import Tensor

from gradmod.hooks import stages
from gradmod.optim.param_groups import describe
from gradmod.optim.rates import group_rates
from gradmod.reporting.observe import GradCamProbe
from gradmod.run.factories import (
    build_scheduler,
    build_tasks,
    model_factory,
    model_optimizer,
)
from gradmod.run.folder.checkpointing import Checkpointer
from gradmod.run.state import Run
from gradmod.training.callbacks import NonFiniteCallback
from gradmod.training.curvature import Curvature
from gradmod.training.divergence import DivergenceCallback
from gradmod.training.loader import steps_per_epoch
from gradmod.training.nonfinite import NonFiniteGuard
from gradmod.training.precision import Precision
from gradmod.training.privacy import PrivacyCallback
from gradmod.training.schedule import SchedulerCallback
from gradmod.training.speed import compile_model
from gradmod.training.trainer import Trainer, TrainerSettings

log = logging.getLogger("gradmod.run.runner")


@dataclasses.dataclass(frozen=True)
class Parts:
    """The Trainer and the callbacks the run reads again at its end."""

    trainer: Trainer
    saver: Checkpointer
    guard: NonFiniteGuard
    probe: GradCamProbe | None
    curvature: Curvature | None = None  # the curvature rules' estimates


def _compilable(wrapped: Any, run: Run) -> Any:
    """``wrapped``, where no rule differentiates the model's backward again (an exact penalty),
    which a compiled model's backward cannot."""
    rule = next((r for stage in run.hooks.stages if (r := stage.double_backward()) is not None), None)
    if rule is not None:
        raise ValueError(
            f"trainer.compile=true: hooks.{rule} adds a term of the loss's own gradient by a double backward "
            "through the model, which a compiled model's backward cannot (torch.compile runs no double backward); "
            "set trainer.compile=false (or the rule's method: finite_difference, two plain passes)"
        )
    return wrapped


def build_trainer(run: Run) -> Parts:
    """The Trainer with the callbacks a checkpoint restores."""
    cfg, t, dist, model = run.cfg, run.cfg.trainer, run.dist, run.model
    wrapped = dist.wrap(model, find_unused=run.hooks.changes_trainability)
    # Hooks are attached to the plain model already; the compiled module shares its parameters.
    net = compile_model(_compilable(wrapped, run)) if t.compile else wrapped
    many = dist.world_size > 1
    guard = NonFiniteGuard(
        model, run.hooks, t.nonfinite, world_sum=_world_sum if many else None, sharded=many and dist.strategy == "fsdp"
    )
    optimizer = model_optimizer(cfg.optimizer, model, dist.device)
    if cfg.optimizer.no_decay or cfg.optimizer.groups or cfg.optimizer.layer_decay is not None:
        log.info("%s", describe(model, optimizer, bool(cfg.optimizer.groups)))
    run.hooks.set_optimizer(optimizer)  # gsam's rho follows its lr, wsam moves after its step
    saver = _saver(run)
    steps = steps_per_epoch(len(run.data.train_y), cfg.data.batch_size, dist.data_size, t.accumulate, run.sampling)
    schedule = SchedulerCallback(build_scheduler(cfg.scheduler, optimizer, steps * t.epochs), group_rates)
    diverged = DivergenceCallback(p for group in optimizer.param_groups for p in group["params"])
    callbacks = [NonFiniteCallback(guard), diverged, schedule, *_observers(run)]
    # Grad-CAM's copy of the model is built now: after the restore it would draw from the restored RNG.
    probe = _probe(run) if cfg.capture.gradcam else None
    settings = TrainerSettings(
        batch_size=cfg.data.batch_size,
        accumulate=t.accumulate,
        eval_batch_size=t.eval_batch_size,
        log_every=t.log_every,
        progress=t.progress and sys.stderr.isatty(),
        loader_workers=run.loader_workers,
        sampling=run.sampling,
    )
    if t.precision == "fp16" and torch.device(dist.device).type == "cpu":
        log.warning(
            "trainer.precision=fp16 on cpu: torch's float16 kernels on a CPU are slow (a small CNN's "
            "step takes about 10x fp32's); bf16 or fp32 train faster there"
        )
    trainer = Trainer(
        model,
        optimizer,
        settings,
        hooks=run.hooks,
        amp=Precision(t.precision, dist.device),
        tasks=build_tasks(cfg.loss, cfg.metric),
        callbacks=[*callbacks, saver],
        dist=dist,
        net=net,
        eval_net=model if net is wrapped else net,
        generator=torch.Generator().manual_seed(cfg.seed),
    )
    return Parts(trainer, saver, guard, probe, next((c for c in callbacks if isinstance(c, Curvature)), None))


def _observers(run: Run) -> list[Any]:
    """DP-SGD's accountant where a rule adds noise; the curvature rules' estimates."""
    out: list[Any] = [_privacy(run)] if run.privacy is not None else []
    return out + ([Curvature(run.curvature)] if run.curvature else [])


def _saver(run: Run) -> Checkpointer:
    t = run.cfg.trainer
    return Checkpointer(
        run.folder.out / "checkpoints",
        every_epochs=t.checkpoint_every,
        every_steps=t.checkpoint_every_steps,
        keep=t.checkpoint_keep,
        epochs=t.epochs,
        config=dataclasses.asdict(run.cfg),
        plan=run.plan,
        writes=run.dist.is_main,
        run=run.claim.run_id,
        started=run.started,
    )


def _privacy(run: Run) -> PrivacyCallback:
    """The accountant of the rule that adds noise (``run.privacy``: what it needs)."""
    cfg, privacy = run.cfg, run.privacy
    assert privacy is not None
    return PrivacyCallback(
        cfg.privacy.accountant,
        cfg.privacy.delta,
        privacy.noise_multiplier,
        privacy.sample_rate,
        sampling=run.sampling,
        target_epsilon=cfg.privacy.target_epsilon,
        clip=run.hooks.stage(stages.counting_examples()).noisy,
        noise_at=privacy.noise_at if privacy.sigmas is not None else None,
    )


def _probe(run: Run) -> GradCamProbe:
    cfg = run.cfg
    return GradCamProbe(
        model_factory(cfg.model, run.data),
        run.data,
        cfg.capture.gradcam_layer,
        cfg.capture.gradcam_images,
        run.dist.device,
    )


def _world_sum(t: Tensor) -> Tensor:
    torch.distributed.all_reduce(t)
    return t
