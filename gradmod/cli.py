"""The command-line job behind ``train.py``: one Hydra job -> one training run.

Bad input (a ``ValueError`` from checking the config against the model and data) is one
line on stderr and exit status 2; ``HYDRA_FULL_ERROR=1`` shows the traceback instead.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from gradmod.train import run

log = logging.getLogger("gradmod")


def job(cfg: DictConfig) -> dict[str, Any]:
    out_dir = HydraConfig.get().runtime.output_dir
    try:
        return run(cfg, out_dir)
    except ValueError as e:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        log.error("%s", e)
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
