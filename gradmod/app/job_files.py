"""The files Hydra would write into a run folder as a job starts, ``.hydra/`` and
``train.log``, written by gradmod instead once the run owns the folder: a run refused
before then (a folder in use, an earlier run's results, a resume that does not fit)
leaves them as they were. Hydra's own writing is off in gradmod/conf/config.yaml
(``hydra.output_subdir: null`` and ``hydra/job_logging: gradmod``, which has no file).
Log records before that moment are held and written to ``train.log`` when it opens.
"""

from __future__ import annotations

import logging
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from gradmod.app.config_store import as_built
from gradmod.run.folder import atomic

FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"  # Hydra's job log format


class _Held(logging.Handler):
    """Keeps the records until the run's log file opens."""

    def __init__(self):
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


class JobFiles:
    """``with JobFiles(hydra_cfg, cfg) as files:`` holds the job's log records; ``files.write(out)``
    writes ``out/.hydra/{config,hydra,overrides}.yaml`` and opens ``out/<job name>.log``
    (appending, as Hydra does, to a copy renamed over the old log) with the held records first. Leaving the block closes it."""

    def __init__(self, hydra_cfg: DictConfig, cfg: DictConfig):
        built = as_built(cfg)  # a _target_ object's name, not the shipped default it replaced
        self.texts = {
            "config.yaml": OmegaConf.to_yaml(cfg if built is None else built),  # before the job changes it
            "hydra.yaml": OmegaConf.to_yaml(OmegaConf.create({"hydra": hydra_cfg})),
            "overrides.yaml": OmegaConf.to_yaml(hydra_cfg.overrides.task),
        }
        self.log_name = f"{hydra_cfg.job.name}.log"
        self.held = _Held()
        self.file: logging.FileHandler | None = None

    def __enter__(self) -> JobFiles:
        logging.getLogger().addHandler(self.held)
        return self

    def write(self, out: str | Path) -> None:
        """The job's config and log in ``out`` (once; later calls do nothing)."""
        if self.file is not None:
            return
        folder = Path(out) / ".hydra"
        folder.mkdir(parents=True, exist_ok=True)
        for name, text in self.texts.items():
            atomic.write_text(folder / name, text)
        # A continuation appends to a copy of its own (a hard-linked backup keeps the old log).
        log_file = atomic.fresh(Path(out) / self.log_name, keep=True)
        self.file = logging.FileHandler(log_file, mode="a", encoding="utf-8")
        self.file.setFormatter(logging.Formatter(FORMAT))
        root = logging.getLogger()
        for record in self.held.records:
            self.file.handle(record)
        root.removeHandler(self.held)
        root.addHandler(self.file)

    def __exit__(self, *exc) -> None:
        root = logging.getLogger()
        root.removeHandler(self.held)
        if self.file is not None:
            root.removeHandler(self.file)
            self.file.close()
