"""The command-line job behind ``train.py``: one Hydra job -> one training run.

Bad input (a ``ValueError`` from checking the config against the model and data) is one
line on stderr and exit status 2; ``HYDRA_FULL_ERROR=1`` shows the traceback instead.

In a multirun (``-m``) a job that raises must not end the sweep: its folder gets a
``summary.json`` with ``status: failed`` and the error, its log the traceback, and the
sweep goes on; the sweep report (``gradmod.sweep.SweepReport``) exits non-zero at the end.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from gradmod.sweep import failed_summary, format_exception, launcher_threads
from gradmod.train import run

log = logging.getLogger("gradmod")

# ${negate:x} in configs: a symmetric clamp from one tuned bound (conf/experiment/clip_optuna.yaml).
OmegaConf.register_new_resolver("negate", lambda x: -x, replace=True)


def job(cfg: DictConfig) -> dict[str, Any]:
    hydra_cfg = HydraConfig.get()
    out_dir = hydra_cfg.runtime.output_dir
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    if multirun and not cfg.trainer.get("threads"):
        # Jobs running side by side (joblib) share the cores: cores // n_jobs threads each.
        threads = launcher_threads(hydra_cfg.launcher)
        if threads:
            cfg.trainer.threads = threads
    start = time.perf_counter()
    try:
        return run(cfg, out_dir)
    except Exception as e:
        if not multirun and (not isinstance(e, ValueError) or os.environ.get("HYDRA_FULL_ERROR") == "1"):
            raise
        rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0)))
        summary = failed_summary(out_dir if rank == 0 else None, e, time.perf_counter() - start)
        if multirun:
            log.error("job failed, the sweep goes on: %s\n%s", e, format_exception(e))
            return summary
        log.error("%s", e)
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
