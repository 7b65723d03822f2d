"""What every logger is: the calls the trainer makes (``Logger``), and the record's tasks as
columns (``flat_tasks``). Its own module, so that a logger in a module of its own
(``mlflow_tracking``) and the choice among them (``loggers.make_logger``) import it alike."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:
    import numpy as np


class Logger:
    """The calls the trainer makes; every method may do nothing."""

    wants_histograms = False  # ask the observers to bin gradients at log steps
    wants_images = False  # Grad-CAM images per epoch

    def log_plan(self, plan: list[dict[str, Any]], text: str) -> None:
        pass

    def log_metrics(self, step: int, record: Mapping[str, Any]) -> None:
        pass

    def log_stats(self, epoch: int, step: int, stats: Mapping[str, Mapping[str, Any]]) -> None:
        pass

    def log_images(self, tag: str, step: int, images: np.ndarray) -> None:
        """``images``: N x H x W x 3 floats in [0, 1]."""

    def close(self) -> None:
        pass


def flat_tasks(record: Mapping[str, Any]) -> dict[str, Any]:
    """The record with ``tasks: {name: {field: v}}`` as columns ``name/field``, and each group's
    rate (``lr_groups``) as ``lr/name``."""
    out = {k: v for k, v in record.items() if k not in ("tasks", "lr_groups")}
    for task, values in record.get("tasks", {}).items():
        out.update({f"{task}/{field}": v for field, v in values.items()})
    out.update({f"lr/{name}": rate for name, rate in (record.get("lr_groups") or {}).items()})
    return out
