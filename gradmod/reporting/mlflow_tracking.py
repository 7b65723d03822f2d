"""``logger=mlflow``: a run as an MLflow run (the ``mlflow`` extra).

The store is ``logger.tracking_uri`` (a server, ``http://host:5000``), else MLflow's own
``MLFLOW_TRACKING_URI``, else a SQLite file in the current folder (``sqlite:///mlflow.db``:
``mlflow ui --backend-store-uri sqlite:///mlflow.db`` shows it). An MLflow run gets:

* params: the resolved config, flattened (``trainer.epochs``, ``hooks.clip.params``, ...);
* metrics at their optimizer step: each epoch's numbers (``train_loss``, ``test_accuracy``,
  ``epsilon``, a task's ``<task>/test_loss``, ...) and every read of the gradient statistics
  as ``grad/<tensor or rule/transform>/<statistic>``;
* artifacts: ``hook_plan.json`` at the start; the plots and ``summary.json`` at the ending;
* its status from the run's ending (tag ``gradmod_status``: ok, failed, interrupted,
  diverged; MLflow's FINISHED, FAILED, KILLED, FAILED).

The MLflow run's id is kept in ``<run>/.gradmod/mlflow.json``: a continuation of the run
(``trainer.resume``) logs into the same MLflow run. A sweep (``-m``) is a parent run with its
jobs as children (``SweepReport`` starts it; ``GRADMOD_MLFLOW_PARENT`` names it to the jobs).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Mapping

from gradmod.reporting.logger_base import Logger, flat_tasks

INSTALL = "pip install 'gradmod[mlflow]'"
RECORD = Path(".gradmod") / "mlflow.json"  # in the run folder: {tracking_uri, run_id, gradmod_run}
PARENT = "GRADMOD_MLFLOW_PARENT"  # a sweep's parent run: "<tracking_uri> <run_id>"
STATUS = {"ok": "FINISHED", "failed": "FAILED", "diverged": "FAILED", "interrupted": "KILLED"}
PLOTS = ("curves.png", "grad_norms.png", "frac_clipped.png", "gradcam.png", "curvature.png")
MAX_PARAM = 6000  # MLflow's limit on a param value's length
BATCH = 1000  # metrics per log_batch call (MLflow's limit)
_OPEN: set[Path] = set()  # run folders whose MLflow run this process logs into (finish ends it)


def client(tracking_uri: str):
    try:
        from mlflow.tracking import MlflowClient
    except ImportError:
        raise ValueError(f"logger.name=mlflow needs the mlflow package, which is not installed: {INSTALL}") from None
    return MlflowClient(tracking_uri=tracking_uri)


def resolve_uri(tracking_uri: str | None) -> str:
    """``logger.tracking_uri``, else ``MLFLOW_TRACKING_URI``, else ./mlflow.db."""
    given = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    return given or f"sqlite:///{Path.cwd() / 'mlflow.db'}"


def experiment_id(mlflow, name: str) -> str:
    found = mlflow.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    try:
        return mlflow.create_experiment(name)
    except Exception:  # another job of the sweep created it first
        found = mlflow.get_experiment_by_name(name)
        if found is None:
            raise
        return found.experiment_id


def flatten(tree: Any, prefix: str = "") -> dict[str, str]:
    """``{"trainer": {"epochs": 2}}`` -> ``{"trainer.epochs": "2"}``; lists by index."""
    items = tree.items() if isinstance(tree, Mapping) else enumerate(tree) if isinstance(tree, list) else None
    if items is None:
        return {prefix: str(tree)[:MAX_PARAM]}
    out: dict[str, str] = {}
    for key, value in items:
        name = f"{prefix}.{key}" if prefix else str(key)
        out.update(flatten(value, name) if isinstance(value, (Mapping, list)) and value else {name: str(value)})
    return out


class MLflowLogger(Logger):
    """The trainer's numbers into one MLflow run (see the module's docstring)."""

    def __init__(
        self,
        out: Path,
        tracking_uri: str | None = None,
        experiment: str = "gradmod",
        config: Mapping[str, Any] | None = None,
        run: str | None = None,
    ):
        self.out, self.uri = Path(out), resolve_uri(tracking_uri)
        self.mlflow = client(self.uri)
        from mlflow.entities import Metric, Param

        self._metric, self._param = Metric, Param
        self._seen: dict[str, int] = {}  # key -> the last step an earlier process logged
        self.run_id = self._continued(run) or self._start(experiment, run)
        _OPEN.add(self.out.resolve())
        self._log_params(flatten(dict(config or {})))

    def _continued(self, run: str | None) -> str | None:
        """The MLflow run of this gradmod run, when the folder continues it in the same store."""
        try:
            kept = json.loads((self.out / RECORD).read_text())
        except (OSError, ValueError):
            return None
        if kept.get("tracking_uri") != self.uri or kept.get("gradmod_run") != run or not kept.get("run_id"):
            return None
        self.mlflow.update_run(kept["run_id"], status="RUNNING")
        # The steps it logged before: a continuation shows the checkpoint's records again.
        for key in self.mlflow.get_run(kept["run_id"]).data.metrics:
            self._seen[key] = max(m.step for m in self.mlflow.get_metric_history(kept["run_id"], key))
        return kept["run_id"]

    def _start(self, experiment: str, run: str | None) -> str:
        tags = {"mlflow.runName": self.out.name, "gradmod_run_folder": str(self.out.resolve())}
        tags |= {"gradmod_run": run} if run else {}
        parent = os.environ.get(PARENT, "").split(" ", 1)
        if len(parent) == 2 and parent[0] == self.uri:
            tags["mlflow.parentRunId"] = parent[1]
        made = self.mlflow.create_run(experiment_id(self.mlflow, experiment), tags=tags)
        record = {"tracking_uri": self.uri, "run_id": made.info.run_id, "gradmod_run": run}
        path = self.out / RECORD
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(record) + "\n")
        os.replace(tmp, path)  # a new file: a hard-linked backup keeps the old record
        return made.info.run_id

    def _log_params(self, params: dict[str, str]) -> None:
        """The config as params; a continuation logs the keys it changed as tags
        ``resumed.<key>`` (an MLflow param is written once)."""
        have = self.mlflow.get_run(self.run_id).data.params
        new = [self._param(k, v) for k, v in params.items() if k not in have]
        changed = {f"resumed.{k}": v for k, v in params.items() if k in have and have[k] != v}
        for i in range(0, len(new), 100):
            self.mlflow.log_batch(self.run_id, params=new[i : i + 100])
        for key, value in changed.items():
            self.mlflow.set_tag(self.run_id, key, value)

    def _log(self, step: int, values: Mapping[str, Any]) -> None:
        now = int(time.time() * 1000)
        metrics = [
            self._metric(key, float(v), now, int(step))
            for key, v in values.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and step > self._seen.get(key, -1)
        ]
        for i in range(0, len(metrics), BATCH):
            self.mlflow.log_batch(self.run_id, metrics=metrics[i : i + BATCH])

    def log_plan(self, plan: list[dict[str, Any]], text: str) -> None:
        self.mlflow.log_dict(self.run_id, plan, "hook_plan.json")

    def log_metrics(self, step: int, record: Mapping[str, Any]) -> None:
        skip = ("step", "grad_stats")  # the step is the axis; grad_stats arrive through log_stats
        self._log(step, {k: v for k, v in flat_tasks(record).items() if k not in skip})

    def log_stats(self, epoch: int, step: int, stats: Mapping[str, Mapping[str, Any]]) -> None:
        self._log(step, {f"grad/{key}/{field}": v for key, s in stats.items() for field, v in s.items()})


def finish(out: str | Path, summary: Mapping[str, Any]) -> None:
    """The ending of the run in ``out`` into its MLflow run (where it has one): the plots and
    ``summary.json`` as artifacts, the status mirrored."""
    if Path(out).resolve() not in _OPEN:
        return  # this process opened no MLflow run there (it ended before its logger started)
    _OPEN.discard(Path(out).resolve())
    kept = json.loads((Path(out) / RECORD).read_text())
    mlflow = client(kept["tracking_uri"])
    run_id, status = kept["run_id"], str(summary.get("status"))
    for name in PLOTS:
        if (Path(out) / name).is_file():
            mlflow.log_artifact(run_id, str(Path(out) / name))
    mlflow.log_dict(run_id, dict(summary), "summary.json")
    mlflow.set_tag(run_id, "gradmod_status", status)
    mlflow.set_terminated(run_id, status=STATUS.get(status, "FAILED"))


def start_sweep(tracking_uri: str | None, experiment: str, sweep_dir: str | Path) -> None:
    """A sweep's parent run; its jobs (child processes) find it in ``GRADMOD_MLFLOW_PARENT``."""
    uri = resolve_uri(tracking_uri)
    mlflow = client(uri)
    tags = {"mlflow.runName": f"sweep {Path(sweep_dir).name}", "gradmod_sweep_dir": str(Path(sweep_dir).resolve())}
    made = mlflow.create_run(experiment_id(mlflow, experiment), tags=tags)
    os.environ[PARENT] = f"{uri} {made.info.run_id}"


def end_sweep(report: Mapping[str, Path], statuses: list[str]) -> None:
    """The sweep's report as the parent's artifacts; FINISHED when every job ended ok."""
    parent = os.environ.pop(PARENT, "").split(" ", 1)
    if len(parent) != 2:
        return
    mlflow = client(parent[0])
    for path in report.values():
        if Path(path).is_file():
            mlflow.log_artifact(parent[1], str(path))
    ok = all(s == "ok" for s in statuses)
    mlflow.set_tag(parent[1], "gradmod_status", "ok" if ok else "failed")
    mlflow.set_terminated(parent[1], status="FINISHED" if ok else "FAILED")
