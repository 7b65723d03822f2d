"""Callbacks that write the run folder: metrics, gradient statistics, the logger, plots,
the final model, and Grad-CAM snapshots of fixed test digits.

None of them reads the device between log points: histograms are binned on the device
and come back with the statistics' single read.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import torch

from gradmod.reporting import json_text
from gradmod.reporting.loggers import Logger, names_file
from gradmod.reporting.observe import GradCamProbe
from gradmod.run.folder import atomic
from gradmod.training.callbacks import Callback


class RunFiles(Callback):
    """``metrics.jsonl`` (one line per epoch), ``grad_stats.jsonl`` (one line per log point,
    when a ``log`` is attached), the logger, and at the end ``model.pt``, ``curves.png``,
    ``grad_norms.png``, ``frac_clipped.png`` and ``tasks.png`` (each when it has something to show). Resumed (``trainer.resumed_from``): the
    checkpoint's records are written again and statistics lines after its step dropped.
    ``close()`` closes whatever was opened, however the run ends. A write that fails (a
    full disk) raises an ``OSError`` naming its file."""

    def __init__(self, out: Path, logger: Logger):
        self.out, self.logger = Path(out), logger
        self.rows: list[tuple[int, dict[str, Any]]] = []  # (step, stats) for the plots
        self._files: list[Any] = []  # opened here, closed by close()
        self.metrics = self.stats = None

    def on_fit_start(self, trainer) -> None:
        self.metrics = self._open(atomic.fresh(self.out / "metrics.jsonl"))
        for record in trainer.history:  # resumed: what the checkpoint knew; later lines are redone
            self._write(self.metrics, record)
            self.logger.log_metrics(int(record["step"]), record)
        if trainer.hooks is not None and (trainer.hooks.observers() or trainer.hooks.timed):
            resumed = trainer.step if trainer.resumed_from else None
            self.stats = self._open_stats(self.out / "grad_stats.jsonl", resumed)
        self._arm_histograms(trainer)

    def on_log(self, trainer, stats: dict[str, Any]) -> None:
        self.logger.log_stats(trainer.epoch, trainer.step, stats)
        lean = trainer.last_stats  # this read, without histograms
        self.rows.append((trainer.step, lean))
        if self.stats is not None:
            self._write(self.stats, {"epoch": trainer.epoch, "step": trainer.step, "stats": lean})

    def on_step_end(self, trainer) -> None:
        self._arm_histograms(trainer)

    def on_epoch_end(self, trainer, record: dict[str, Any]) -> None:
        self._write(self.metrics, record)
        self.logger.log_metrics(int(record["step"]), record)

    def on_fit_end(self, trainer) -> None:
        from gradmod.reporting.plots import has_norms, plot_curves, plot_frac_clipped, plot_grad_norms, plot_schedules
        from gradmod.reporting.task_plots import has_tasks, plot_tasks

        buf = io.BytesIO()  # torch.save into a file says only "unexpected pos" when the disk is full
        torch.save(trainer.dist.model_state(trainer.model), buf)  # FSDP2: gathered
        atomic.write_bytes(self.out / "model.pt", buf.getvalue())
        plots = [(plot_curves, trainer.history, "curves.png")]
        if has_norms(self.rows):
            plots.append((plot_grad_norms, self.rows, "grad_norms.png"))
        if any("frac_clipped" in s for _, stats in self.rows for s in stats.values()):
            plots.append((plot_frac_clipped, self.rows, "frac_clipped.png"))
        if any("value" in s for _, stats in self.rows for s in stats.values()):
            plots.append((plot_schedules, self.rows, "schedules.png"))
        for plot, rows, name in plots:
            with names_file(self.out / name):
                plot(rows, self.out / name)
        if has_tasks(self.rows, trainer.history):  # several tasks, or per_loss statistics
            with names_file(self.out / "tasks.png"):
                plot_tasks(self.rows, trainer.history, self.out / "tasks.png")

    def close(self) -> None:
        """Close every file (each error naming its file; the first raised once all are tried)."""
        failed: OSError | None = None
        for f in self._files:
            try:
                with names_file(f.name):
                    f.close()
            except OSError as e:
                failed = failed or e
        self._files.clear()
        if failed is not None:
            raise failed

    def _arm_histograms(self, trainer) -> None:
        """Bin gradients on the device during the step before a log point (TensorBoard)."""
        if self.logger.wants_histograms and trainer.hooks is not None:
            trainer.hooks.set_histograms((trainer.step + 1) % trainer.settings.log_every == 0)

    def _open(self, path: Path):
        with names_file(path):
            f = open(path, "w")
        self._files.append(f)
        return f

    @staticmethod
    def _write(f, record: dict[str, Any]) -> None:
        with names_file(f.name):
            f.write(json_text.dumps(record) + "\n")  # a diverged run's nan: null
            f.flush()

    def _open_stats(self, path: Path, resumed_step: int | None):
        """grad_stats.jsonl; resumed: keep the lines up to the checkpoint's step (and show
        them to the logger and plots again, whose files start afresh), then append."""
        if resumed_step is None or not path.exists():
            return self._open(atomic.fresh(path))
        kept = [(ln, rec) for ln, rec in _stats_lines(path) if rec["step"] <= resumed_step]
        f = self._open(atomic.fresh(path))
        with names_file(path):
            f.write("".join(ln + "\n" for ln, _ in kept))
        for _, rec in kept:
            self.logger.log_stats(rec["epoch"], rec["step"], rec["stats"])
            self.rows.append((rec["step"], rec["stats"]))
        return f


def _stats_lines(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """(line, record) of grad_stats.jsonl; a line cut short (a run killed mid-write) is dropped."""
    out = []
    for ln in path.read_text().splitlines():
        try:
            rec = json.loads(ln)
        except ValueError:
            continue
        if isinstance(rec, dict) and {"epoch", "step", "stats"} <= rec.keys():
            out.append((ln, rec))
    return out


class GradCamCallback(Callback):
    """``capture.gradcam``: Grad-CAM of fixed test digits on a hook-free copy of the model,
    to the logger at each epoch's end (TensorBoard) and as ``gradcam.png`` at the end."""

    def __init__(self, probe: GradCamProbe, logger: Logger, out: Path):
        self.probe, self.logger, self.out = probe, logger, Path(out)

    def on_epoch_end(self, trainer, record: dict[str, Any]) -> None:
        if self.logger.wants_images:
            from gradmod.reporting.plots import gradcam_overlay

            cam = self.probe(trainer.model)
            self.logger.log_images("gradcam", int(record["step"]), gradcam_overlay(cam["images"], cam["cams"]))

    def on_fit_end(self, trainer) -> None:
        from gradmod.reporting.plots import plot_gradcam

        cam = self.probe(trainer.model)
        titles = [f"{y}/{p}" for y, p in zip(cam["labels"], cam["preds"])]
        plot_gradcam(
            torch.from_numpy(cam["images"]),
            torch.from_numpy(cam["cams"]),
            self.out / "gradcam.png",
            titles=titles,
            title=f"Grad-CAM of {self.probe.layer} (label/prediction)",
        )
