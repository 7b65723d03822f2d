"""The Hydra callback that writes a sweep's report when a multirun ends."""

from __future__ import annotations

import logging
import sys
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from gradmod.reporting.sweep_report import write_report

log = logging.getLogger(__name__)


class SweepReport(Callback):
    """Hydra callback: write the sweep's report when a multirun ends, then exit with
    status 1 if any job failed (each job's own failure was recorded, not raised)."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        paths, rows = write_report(config.hydra.sweep.dir)
        bad = [r for r in rows if r["status"] != "ok"]
        log.info("sweep report: %s, %s, %s", *paths.values())
        if bad:
            print(f"error: {len(bad)} of {len(rows)} jobs failed: "
                  + "; ".join(f"job {r['job']}: {r['error']}" for r in bad[:3])
                  + ("; ..." if len(bad) > 3 else "") + f" (see {paths['md']})", file=sys.stderr)
            raise SystemExit(1)
