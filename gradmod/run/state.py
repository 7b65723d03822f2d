"""A run's state in one object: what ``gradmod.run.runner`` built before training, handed
to the steps that build the Trainer and fit it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from torch import nn

from gradmod.data import Data
from gradmod.hooks.hookset import HookSet
from gradmod.run.config import Config
from gradmod.run.dp import Privacy
from gradmod.run.folder.claim import Claim, RunFolder
from gradmod.training.distributed.strategy import Dist
from gradmod.training.interrupt import StopOnSignal


@dataclass(frozen=True)
class Run:
    """One run, built: its config, folder (claimed, not yet owned) and claim, the placed
    process, the checked data and model with the rules attached, and the hook plan."""

    cfg: Config
    folder: RunFolder
    claim: Claim
    dist: Dist
    data: Data
    model: nn.Module
    hooks: HookSet
    plan: Any  # the rules' plan (HookSet.describe): logged, saved with the run and its checkpoints
    stop: StopOnSignal
    started: float  # time.perf_counter() when this process began the run
    loader_workers: int | None = None  # DataLoader workers for host-memory data; None: on the device
    privacy: Privacy | None = None  # DP-SGD's accounting, when a rule adds noise
    sampling: str = "shuffle"  # how batches are drawn: data.sampling resolved (gradmod.run.dp.Plan)
    diffs: dict[str, Any] = field(default_factory=dict)  # what the resume changes (gradmod.run.resume.compare)
    on_owned: Callable[[Path], None] | None = None  # the caller's first writes, once the run owns its folder
    curvature: list[Any] = field(default_factory=list)  # the curvature rules (gradmod.training.curvature)
