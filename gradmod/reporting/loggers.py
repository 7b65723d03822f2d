"""Where a run's numbers go besides ``metrics.jsonl``: the ``logger`` config group.

The trainer always writes ``metrics.jsonl`` and ``grad_stats.jsonl``; a logger adds a
view of the same numbers. ``csv`` (the default, no extra dependency) writes
``metrics.csv`` and ``grad_stats.csv``; ``tensorboard`` (the optional extra) writes event
files under ``<run folder>/tensorboard``: scalars, gradient histograms, the hook plan as
text and Grad-CAM images; ``mlflow`` (an extra) an MLflow run (``mlflow_tracking``).

Statistics keys are ``tensor`` or ``tensor/label`` (``label`` is ``pre``/``post`` for a
``log`` first and last in a rule), as ``HookSet.read_stats`` returns them.
"""

from __future__ import annotations

import contextlib
import csv
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from gradmod.reporting.logger_base import Logger, flat_tasks

if TYPE_CHECKING:  # numpy starts a native thread (OpenBLAS') at import: the sweep's parent stays without
    import numpy as np

LOGGERS = ("csv", "tensorboard", "mlflow")
STAT_COLUMNS = (
    "norm",
    "min",
    "max",
    "mean",
    "frac_negative",
    "nonfinite",
    "frac_clipped",
    "calls",
    "norm_max",
    "clip_coef",
    "clip_coef_min",
    "value",
)  # norm_max, clip_coef, clip_coef_min: group transforms (rule/transform);
# value: a scheduled argument's (rule/transform.arg) or a window's (rule/active: 1 open, 0 closed)


@contextlib.contextmanager
def names_file(path: str | Path):
    """An ``OSError`` that does not say which file (a write or flush to a full disk) names ``path``."""
    try:
        yield
    except OSError as e:
        if e.filename:
            raise
        raise OSError(e.errno, e.strerror or str(e), str(path)) from None


def _new_file(path: Path) -> Path:
    """``path`` unlinked before it is opened for writing: a new file, so that a hard link to
    the old one elsewhere (a ``cp -al`` backup of the run folder) keeps what it held."""
    with names_file(path):
        path.unlink(missing_ok=True)
    return path


def split_key(key: str) -> tuple[str, str]:
    """``"conv1.weight/pre"`` -> ``("conv1.weight", "pre")``; no label -> ``""``."""
    tensor, _, label = key.partition("/")
    return tensor, label


class CSVLogger(Logger):
    """``metrics.csv`` (one row per epoch, the scalar metrics) and ``grad_stats.csv``
    (one row per observed tensor per read), for spreadsheets and pandas."""

    def __init__(self, out: Path):
        self._out = out
        self._metrics_file = open(_new_file(out / "metrics.csv"), "w", newline="")
        self._metrics: csv.DictWriter | None = None
        self._stats_file = None  # opened at the first statistics: runs without `log` get no grad_stats.csv
        self._stats: csv.DictWriter | None = None

    def _stats_writer(self) -> csv.DictWriter:
        if self._stats is None:
            self._stats_file = open(_new_file(self._out / "grad_stats.csv"), "w", newline="")
            self._stats = csv.DictWriter(
                self._stats_file, ["epoch", "step", "tensor", "label", *STAT_COLUMNS], extrasaction="ignore"
            )
            self._stats.writeheader()
        return self._stats

    def log_metrics(self, step: int, record: Mapping[str, Any]) -> None:
        record = flat_tasks(record)
        if self._metrics is None:  # columns: the scalars of the first record
            columns = [k for k, v in record.items() if isinstance(v, (int, float, str))]
            self._metrics = csv.DictWriter(self._metrics_file, columns, extrasaction="ignore")
            self._metrics.writeheader()
        with names_file(self._metrics_file.name):
            self._metrics.writerow(dict(record))
            self._metrics_file.flush()

    def log_stats(self, epoch: int, step: int, stats: Mapping[str, Mapping[str, Any]]) -> None:
        if not stats:
            return
        writer = self._stats_writer()
        with names_file(self._stats_file.name):
            for key, s in stats.items():
                tensor, label = split_key(key)
                writer.writerow({"epoch": epoch, "step": step, "tensor": tensor, "label": label, **s})
            self._stats_file.flush()

    def close(self) -> None:
        for f in (self._metrics_file, self._stats_file):
            if f is not None:
                with names_file(f.name):
                    f.close()


class TensorBoardLogger(Logger):
    """Event files under ``<run folder>/tensorboard`` (``tensorboard --logdir outputs``).

    Tags: ``loss/train``, ``loss/test``, ``accuracy/test``; ``grad_norm/<key>`` and
    ``frac_clipped/<tensor>`` (from ``post``); histograms ``grad/<key>``; text
    ``hook_plan``; images ``gradcam``. The step axis is the optimizer step.
    """

    wants_images = True

    def __init__(self, out: Path, histograms: bool = True):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ValueError(
                "logger.name=tensorboard needs the tensorboard package, which is not installed; "
                "pip install 'gradmod[tensorboard]', or use logger=csv"
            ) from None
        self.wants_histograms = bool(histograms)
        self.log_dir = out / "tensorboard"
        self.writer = SummaryWriter(log_dir=str(self.log_dir))

    def log_plan(self, plan: list[dict[str, Any]], text: str) -> None:
        # Indented lines are a code block in TensorBoard's markdown: columns stay aligned.
        self.writer.add_text("hook_plan", "\n".join("    " + line for line in text.splitlines()), 0)

    def log_metrics(self, step: int, record: Mapping[str, Any]) -> None:
        for field, tag in (
            ("train_loss", "loss/train"),
            ("test_loss", "loss/test"),
            ("test_accuracy", "accuracy/test"),
            ("test_metric", "metric/test"),
            ("lr", "lr"),
        ):
            if record.get(field) is not None:
                self.writer.add_scalar(tag, record[field], step)
        for name, rate in (record.get("lr_groups") or {}).items():
            self.writer.add_scalar(f"lr/{name}", rate, step)
        for task, values in record.get("tasks", {}).items():
            for field, value in values.items():
                if value is not None:
                    self.writer.add_scalar(f"{field.replace('test_', '')}/test/{task}", value, step)
        for key, value in record.items():  # a curvature rule's latest estimate: <rule>/<group>/top1, trace, ...
            if key.count("/") == 2 and isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def log_stats(self, epoch: int, step: int, stats: Mapping[str, Mapping[str, Any]]) -> None:
        for key, s in stats.items():
            if "norm" in s:
                self.writer.add_scalar(f"grad_norm/{key}", s["norm"], step)
            for field in ("norm_mean", "norm_max", "p50", "p90", "max"):  # per_sample: each example's norm
                if field in s and "norm" not in s:
                    self.writer.add_scalar(f"per_example_norm/{key}/{field}", s[field], step)
            if "frac_clipped" in s:
                self.writer.add_scalar(f"frac_clipped/{split_key(key)[0]}", s["frac_clipped"], step)
            if "value" in s:  # a scheduled argument's value in use, or whether a window is open
                self.writer.add_scalar(f"schedule/{key}", s["value"], step)
            h = s.get("histogram")
            if h is not None:
                self.writer.add_histogram_raw(
                    f"grad/{key}",
                    h["min"],
                    h["max"],
                    h["num"],
                    h["sum"],
                    h["sum_squares"],
                    h["bucket_limits"],
                    h["bucket_counts"],
                    step,
                )

    def log_images(self, tag: str, step: int, images: np.ndarray) -> None:
        self.writer.add_images(tag, images, step, dataformats="NHWC")
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def make_logger(
    cfg: Mapping[str, Any] | None, out: str | Path, config: Mapping[str, Any] | None = None, run: str | None = None
) -> Logger:
    """The logger a ``logger`` config names (``None``: ``csv``); ``config`` (the run's
    resolved config) and ``run`` (its id) go to ``mlflow``, as its params and its resume key."""
    name, cfg = _options(cfg)
    if name == "mlflow":
        from gradmod.reporting.mlflow_tracking import MLflowLogger

        return MLflowLogger(Path(out), config=config, run=run, **cfg)
    return CSVLogger(Path(out)) if name == "csv" else TensorBoardLogger(Path(out), **cfg)


def check_logger(cfg: Mapping[str, Any] | None) -> None:
    """Before the run starts: one line for what ``make_logger`` would refuse, and for an MLflow
    store the run could not log into (``gradmod.reporting.mlflow_store``)."""
    name, options = _options(cfg)
    if name == "mlflow":
        from gradmod.reporting.mlflow_store import check_store

        check_store(options.get("tracking_uri"), options.get("experiment", "gradmod"))


def _options(cfg: Mapping[str, Any] | None) -> tuple[str, dict[str, Any]]:
    """The logger's name and its options, checked."""
    cfg = dict(cfg or {"name": "csv"})
    name = cfg.pop("name", "csv")
    if name == "csv":
        allowed: tuple[str, ...] = ()
    elif name == "tensorboard":
        allowed = ("histograms",)
    elif name == "mlflow":
        allowed = ("tracking_uri", "experiment")
    else:
        raise ValueError(f"logger.name={name!r} is not a logger; allowed: {', '.join(LOGGERS)}")
    unknown = [k for k in cfg if k not in allowed]
    if unknown:
        raise ValueError(
            f"logger={name} got unknown key(s) {', '.join(map(str, unknown))}; "
            f"allowed: {', '.join(('name',) + allowed)}"
        )
    return name, cfg
