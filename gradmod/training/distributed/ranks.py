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
