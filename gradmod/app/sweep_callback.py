"""The Hydra callback that writes a sweep's report when a multirun ends."""

from __future__ import annotations

import logging
import sys
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from gradmod.reporting import sweep_jobs
from gradmod.reporting.sweep_report import write_report

log = logging.getLogger(__name__)


class SweepReport(Callback):
    """Hydra callback: forget an earlier sweep's job records when a multirun starts; when it
    ends, write the report from this sweep's records and exit with status 1 if any job did not
    end ``ok`` (failed, refused, killed, ...: each job's ending was recorded, not raised)."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_jobs.clear(config.hydra.sweep.dir)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        paths, rows = write_report(config.hydra.sweep.dir, ended=True)
        bad = [r for r in rows if r["status"] != "ok"]
        log.info("sweep report: %s, %s, %s", *paths.values())
        if bad:
            print(f"error: {len(bad)} of {len(rows)} jobs did not end ok: "
                  + "; ".join(f"job {r['job']} {r['status']}: {r['error']}" for r in bad[:3])
                  + ("; ..." if len(bad) > 3 else "") + f" (see {paths['md']})", file=sys.stderr)
            raise SystemExit(1)
