"""This process's rank as its launcher tells it, without torch: the command line reads it
before any heavy import (``gradmod.training.distributed.strategy`` builds the process group)."""

from __future__ import annotations

import os
from collections.abc import Mapping


def env_rank(environ: Mapping[str, str] | None = None) -> int:
    """This process's rank as its launcher tells it (torchrun: RANK; SLURM: SLURM_PROCID); 0 alone."""
    env = os.environ if environ is None else environ
    return int(env.get("RANK", env.get("SLURM_PROCID", 0)))


def follower_overrides(argv: list[str], environ: Mapping[str, str] | None = None) -> list[str]:
    """Hydra overrides for torchrun ranks > 0 of a single run: no run folder of their own
    (rank 0 alone writes it), and only warnings on the console."""
    if env_rank(environ) == 0 or {"-m", "--multirun"} & set(argv):
        return []
    return [
        "hydra.run.dir=.",
        "hydra.output_subdir=null",
        "hydra/job_logging=stdout",
        "hydra.job_logging.root.level=WARNING",
    ]


def node_cores() -> int:
    """The cores this process may run on (its affinity: a container's or a scheduler's share)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity (macOS)
        return os.cpu_count() or 1


def rank_threads(environ: Mapping[str, str] | None = None, cores: int | None = None) -> int:
    """Torch threads for one process of a multi-process run where its launcher chose none:
    the node's cores divided by the processes on it (LOCAL_WORLD_SIZE), at least 1. torchrun
    sets OMP_NUM_THREADS=1 for several processes a node but nothing for one, where each rank
    would take every core of the machine it shares (two nodes' ranks on one host). 0 (torch's
    own choice): one process alone, or OMP_NUM_THREADS given."""
    env = os.environ if environ is None else environ
    if int(env.get("WORLD_SIZE", 1)) <= 1 or env.get("OMP_NUM_THREADS"):
        return 0
    local = int(env.get("LOCAL_WORLD_SIZE", 1))
    return max(1, (node_cores() if cores is None else cores) // max(1, local))
