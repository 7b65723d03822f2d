"""DistributedDataParallel: one process per rank, gloo on the CPU, nccl on GPUs.

``torchrun --nproc_per_node=N train.py trainer.strategy=ddp`` starts N copies of the job;
torchrun (or SLURM, through submitit) tells each its rank in the environment. Every rank
builds the same model from the same seed, attaches the hook rules to the *plain* model
(names without DDP's ``module.`` prefix), then wraps it in DDP. Each rank trains on its
own share of every epoch's seeded permutation, evaluates its share of the test set and
the results are averaged, so every rank holds the same numbers; rank 0 alone writes the
run folder.

Where the stages run (the all-reduce averages gradients over the ranks):

* ``hook``: the tensor hook runs on each rank's *local* gradient before it reaches
  ``.grad``; DDP's reducer reads ``.grad`` afterwards, so the step uses the mean of the
  transformed local gradients, e.g. ``mean_r clamp(g_r)``.
* ``fused``: runs after ``backward()`` returns, when DDP has already averaged ``.grad``:
  ``clamp(mean_r g_r)``.
* ``per_sample``: DDP's all-reduce never runs (every backward under ``no_sync``); the
  clipped sums are all-reduced once, with one noise draw (``gradmod.training.dpsgd``).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

STRATEGIES = ("single", "ddp")


@dataclass
class Dist:
    """This process's place in the run. ``Dist()`` is a single process."""

    strategy: str = "single"
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that writes the run folder."""
        return self.rank == 0

    @property
    def shard(self) -> slice:
        """This rank's share of a tensor indexed along dim 0 (every element exactly once)."""
        return slice(self.rank, None, self.world_size)

    @classmethod
    def from_env(cls, strategy: str, device: torch.device) -> "Dist":
        """Read the rank from the environment and check it; starts nothing."""
        if strategy not in STRATEGIES:
            raise ValueError(f"trainer.strategy={strategy!r} is not a strategy; allowed: {', '.join(STRATEGIES)}")
        world = int(os.environ.get("WORLD_SIZE", 1))
        if strategy == "single":
            if world > 1:
                raise ValueError(f"trainer.strategy=single but this is one of {world} processes (WORLD_SIZE); "
                                 "add trainer.strategy=ddp")
            return cls(device=device)
        if "RANK" not in os.environ and "SLURM_PROCID" in os.environ:
            import submitit  # SLURM tasks (hydra/launcher=slurm): same variables as torchrun

            submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
        if "RANK" not in os.environ:
            raise ValueError("trainer.strategy=ddp needs the process environment torchrun sets (RANK, WORLD_SIZE, "
                             "MASTER_ADDR); run: torchrun --nproc_per_node=N train.py trainer.strategy=ddp")
        rank, world, local = env_rank(), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
        if device.type == "cuda":
            device = torch.device("cuda", local)  # one GPU per process
            torch.cuda.set_device(device)
        return cls("ddp", rank, world, local, device)

    def wrap(self, model: nn.Module) -> nn.Module:
        """Start the process group and wrap ``model`` in DDP (single: ``model`` itself).

        Attach hooks before: DDP then sees gradients the hooks already transformed."""
        if self.strategy == "single":
            return model
        if not dist.is_initialized():
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo")
        return DDP(model, device_ids=[self.device.index] if self.device.type == "cuda" else None)

    def mean(self, values: list[float], weight: float = 1.0) -> list[float]:
        """The ``weight``-weighted mean over ranks of per-rank values; the same on every rank."""
        if self.strategy == "single":
            return list(values)
        t = torch.tensor([*(v * weight for v in values), weight], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return (t[:-1] / t[-1]).tolist()

    def close(self) -> None:
        if self.strategy != "single" and dist.is_initialized():
            dist.destroy_process_group()


def unwrap(model: nn.Module) -> nn.Module:
    """The plain model inside DDP (its state dict has no ``module.`` prefix)."""
    return model.module if isinstance(model, DDP) else model


def no_sync(model: nn.Module, skip: bool):
    """DDP's ``no_sync()`` when ``skip`` (a micro-batch before the last of a step): the
    gradient accumulates locally and is all-reduced once, with the last micro-batch."""
    return model.no_sync() if skip and isinstance(model, DDP) else contextlib.nullcontext()


def env_rank(environ: Mapping[str, str] | None = None) -> int:
    """This process's rank as its launcher tells it (torchrun: RANK; SLURM: SLURM_PROCID); 0 alone."""
    env = os.environ if environ is None else environ
    return int(env.get("RANK", env.get("SLURM_PROCID", 0)))


def follower_overrides(argv: list[str], environ: Mapping[str, str] | None = None) -> list[str]:
    """Hydra overrides for torchrun ranks > 0 of a single run: no run folder of their own
    (rank 0 alone writes it), and only warnings on the console."""
    if env_rank(environ) == 0 or {"-m", "--multirun"} & set(argv):
        return []
    return ["hydra.run.dir=.", "hydra.output_subdir=null", "hydra/job_logging=stdout",
            "hydra.job_logging.root.level=WARNING"]
