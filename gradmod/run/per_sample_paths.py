"""Which path each per_sample parameter takes, known after the first step (the stage sets
itself up at the model's first training forward): one console line, and ``path`` added to
the parameter's rows of ``hook_plan.json``. A ``general`` path (torch.func replaying a module
per example) is the slow one; the line names where it happens."""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path
from typing import Any

from gradmod.reporting import json_text
from gradmod.run.folder import atomic
from gradmod.training.callbacks import Callback

log = logging.getLogger(__name__)


def paths_line(paths: dict[str, str]) -> str:
    """``per_sample paths: 40 closed form, 12 Gram, 2 general: torch.func over encoder``."""
    counts = Counter(paths.values())
    shown = ", ".join(f"{n} {path}" for path, n in counts.most_common())
    return f"per_sample paths ({len(paths)} parameters): {shown}"


class PerSamplePaths(Callback):
    """After the first optimizer step: the console line and the paths in ``hook_plan.json``
    (``plan``: the rows the run wrote at its start; the checkpoints keep those)."""

    def __init__(self, folder: Path, plan: list[dict[str, Any]], stage: Any):
        self.file, self.plan, self.stage, self.done = folder / "hook_plan.json", plan, stage, False

    def on_step_end(self, trainer) -> None:
        paths = self.stage.paths()
        if self.done or not paths:
            return
        self.done = True
        log.info("%s", paths_line(paths))
        rows = [
            {**row, "path": paths[row["tensor"]]}
            if row.get("stage") == self.stage.name and row.get("tensor") in paths
            else row
            for row in self.plan
        ]
        atomic.write_text(self.file, json_text.dumps(rows, indent=2) + "\n")
