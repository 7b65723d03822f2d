"""Sweeps: the report a multirun leaves in its folder, and the pieces jobs need for it.

At the end of ``python train.py -m ...`` the ``SweepReport`` callback (``gradmod.app.sweep_callback``,
registered in ``gradmod/conf/config.yaml`` under ``hydra.callbacks``) writes, into the sweep folder:

* ``sweep.csv``: one row per job (``COLUMNS``): its overrides, status, final test accuracy
  and loss, the clipping statistics it recorded (mean over its log reads of ``clip_coef``,
  ``frac_clipped`` and the total gradient norm), skipped steps, seconds and error; for a
  multi-task sweep then each task's test metric and loss (``TASK/test_metric``, ...);
* ``sweep.md``: the same table in Markdown (the overrides that differ between jobs; the
  shared ones above the table), then one row per group of jobs that differ only in
  ``seed=``: accuracy and loss as mean +- std over the seeds, the statistics' means, ranked
  by ``report.metric`` in its direction (``sweep_rank``), and a note naming the groups within
  the seed spread of the best; with several tasks, a table of each task's metric (accuracy,
  rmse or one's own) as mean +- std over the seeds, per group;
* ``sweep_curves.png``: every job's test accuracy and loss per epoch, one colour per group.

A job's ending comes from the record it wrote itself (``sweep_jobs``: ok, failed, refused,
interrupted, killed, ...); its curve and statistics from the ``metrics.jsonl`` and
``grad_stats.jsonl`` it wrote (never an earlier run's, left in a folder that refused the
job). A sweep folder without records (older sweeps) is read from its job folders (a
``summary.json`` each, or ``incomplete``). ``python scripts/sweep_report.py PATH`` rebuilds it.
"""

from __future__ import annotations

import csv
import json
import logging
import statistics
from pathlib import Path
from typing import Any, Mapping

import yaml

from gradmod.reporting import run_summary, sweep_jobs
from gradmod.reporting.sweep_rank import Ranking, ordered, ranking, spread_note

log = logging.getLogger(__name__)

COLUMNS = (
    "job",
    "overrides",
    "status",
    "test_accuracy",
    "test_loss",
    "clip_coef",
    "frac_clipped",
    "total_norm",
    "skipped_steps",
    "seconds",
    "error",
)
STATS = ("clip_coef", "frac_clipped", "total_norm")
FILES = {"csv": "sweep.csv", "md": "sweep.md", "png": "sweep_curves.png"}


# --- what jobs write -------------------------------------------------------------------


def launcher_threads(launcher: Mapping[str, Any] | None, cores: int | None = None) -> int:
    """Torch threads for one job of a sweep: ``cores // n_jobs`` under the joblib launcher
    (which runs ``n_jobs`` jobs at once; -1 is every core, -2 all but one, as in joblib),
    a Ray job's ``num_cpus``; 0 for the others (torch's default, or the share their
    environment gives: ``gradmod.app.launchers.job_threads``)."""
    target = str((launcher or {}).get("_target_", ""))
    if target.endswith("RayLauncher"):  # the cores Ray reserves for each job
        return int(float(launcher.get("num_cpus") or 0))
    if not target.endswith("JoblibLauncher"):
        return 0
    if cores is None:
        import joblib

        cores = joblib.cpu_count()
    n_jobs = int(launcher.get("n_jobs") or -1)
    if n_jobs < 0:
        n_jobs = max(1, cores + 1 + n_jobs)
    if n_jobs > cores:
        log.warning(
            "hydra.launcher.n_jobs=%d is more than the %d cores: the jobs share them; "
            "set hydra.launcher.n_jobs=%d or fewer",
            n_jobs,
            cores,
            cores,
        )
    return max(1, cores // n_jobs)


# --- reading a sweep folder ------------------------------------------------------------


def _job_key(path: Path, root: Path) -> tuple:
    rel = path.relative_to(root).parts
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in rel)


def job_dirs(sweep_dir: str | Path) -> list[Path]:
    """The job folders under a sweep folder (Hydra's ``.hydra/`` or a ``summary.json``),
    in job order."""
    root = Path(sweep_dir)
    found = {p.parent.parent for p in root.rglob(".hydra/overrides.yaml")}
    found |= {p.parent for p in root.rglob("summary.json")}
    found.discard(root)
    return sorted(found, key=lambda p: _job_key(p, root))


def _json_lines(path: Path) -> list[dict[str, Any]]:
    """The records of a ``.jsonl`` file; a line cut short by a killed job is left out."""
    out = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def _curve(job_dir: Path) -> list[dict[str, Any]]:
    """The epochs of ``metrics.jsonl``: epoch, test_accuracy, test_loss."""
    keys = ("epoch", "test_accuracy", "test_loss")
    return [{k: r[k] for k in keys} for r in _json_lines(job_dir / "metrics.jsonl") if all(k in r for k in keys)]


def _mean(values: list[float]) -> float | None:
    values = [v for v in values if isinstance(v, (int, float))]
    return statistics.fmean(values) if values else None


def clip_stats(job_dir: Path) -> dict[str, float | None]:
    """Means over the job's log reads (``grad_stats.jsonl``): a group transform's ``clip_coef``,
    ``frac_clipped`` (the fraction of its steps clipped) and total norm before clipping;
    without a group transform, ``frac_clipped`` of the per-tensor ``log`` reads (the
    fraction of elements changed)."""
    reads = [
        s
        for rec in _json_lines(job_dir / "grad_stats.jsonl")
        for s in (rec.get("stats") or {}).values()
        if isinstance(s, dict)
    ]
    group = [s for s in reads if "clip_coef" in s]
    if group:
        return {
            "clip_coef": _mean([s["clip_coef"] for s in group]),
            "frac_clipped": _mean([s.get("frac_clipped") for s in group]),
            "total_norm": _mean([s.get("norm") for s in group]),
        }
    return {
        "clip_coef": None,
        "frac_clipped": _mean([s["frac_clipped"] for s in reads if "frac_clipped" in s]),
        "total_norm": None,
    }


def _row(job: str, overrides: list[str], ending: Mapping[str, Any], job_dir: Path | None) -> dict[str, Any]:
    """One job's row: its ending, plus the curve and statistics it wrote (``job_dir``, or None)."""
    stats = clip_stats(job_dir) if job_dir is not None else dict.fromkeys(STATS)
    return {
        "job": job,
        "overrides": overrides,
        "status": ending.get("status", "ok"),
        "test_accuracy": ending.get("test_accuracy"),
        "test_loss": ending.get("test_loss"),
        "epsilon": (ending.get("privacy") or {}).get("epsilon"),  # a DP job's (noise added)
        "tasks": ending.get("tasks") or {},
        **stats,
        "skipped_steps": ending.get("skipped_steps"),
        "seconds": ending.get("seconds"),
        "error": ending.get("error") or "",
        "curve": _curve(job_dir) if job_dir is not None else [],
    }


def read_job(job_dir: Path, root: Path) -> dict[str, Any]:
    """A job's row from its folder alone (a sweep folder without job records)."""
    overrides_file = job_dir / ".hydra" / "overrides.yaml"
    overrides = [str(o) for o in yaml.safe_load(overrides_file.read_text()) or []] if overrides_file.exists() else []
    summary = run_summary.read(job_dir)  # a run killed while running reads as killed
    if summary is None:
        summary = {"status": "incomplete", "error": "no summary.json (killed, or still running)"}
    return _row(job_dir.relative_to(root).as_posix(), overrides, summary, job_dir)


def _record_row(record: Mapping[str, Any]) -> dict[str, Any]:
    """A job's row from its own record; the folder's files only where this job wrote them."""
    job_dir = Path(record.get("dir", ""))
    mine = sweep_jobs.written_by(job_dir / "metrics.jsonl", record)
    return _row(str(record.get("job")), list(record.get("overrides") or []), record, job_dir if mine else None)


def collect(sweep_dir: str | Path, *, ended: bool = False) -> list[dict[str, Any]]:
    """Every job's row: from this sweep's job records, else from the job folders."""
    root = Path(sweep_dir)
    records = sweep_jobs.read(root, ended=ended)
    if records is not None:
        return [_record_row(r) for r in records]
    return [read_job(d, root) for d in job_dirs(root)]


# --- writing the report ----------------------------------------------------------------


def _varying(rows: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """(overrides shared by every job, each job's other overrides)."""
    shared = [o for o in rows[0]["overrides"] if all(o in r["overrides"] for r in rows)] if rows else []
    return shared, [[o for o in r["overrides"] if o not in shared] for r in rows]


def _num(value: Any, digits: int) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def group_of(overrides: list[str]) -> str:
    """The group a job belongs to: its overrides other than ``seed=``."""
    return " ".join(o for o in overrides if not o.lstrip("+~").startswith("seed=")) or "(all)"


def _spread(values: list[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else None)


def by_group(rows: list[dict[str, Any]], rank: Ranking | None = None) -> list[dict[str, Any]]:
    """Per group of jobs that differ only in ``seed=``: how many ended ok, the ranking's
    number (``score``), accuracy and loss as mean and sample std over them, and the means of
    the statistics, skipped steps and seconds; best score first (``sweep_rank``)."""
    rank = rank or ranking(rows)
    groups: dict[str, list[dict[str, Any]]] = {}
    for row, own in zip(rows, _varying(rows)[1]):
        groups.setdefault(group_of(own), []).append(row)
    out = []
    for name, members in groups.items():
        ok = [r for r in members if r["status"] == "ok"]
        score, score_std = _spread([v for v in map(rank.value, ok) if v is not None])
        acc, acc_std = _spread([r["test_accuracy"] for r in ok if r["test_accuracy"] is not None])
        loss, loss_std = _spread([r["test_loss"] for r in ok if r["test_loss"] is not None])
        out.append(
            {
                "group": name,
                "jobs": len(members),
                "ok": len(ok),
                "score": score,
                "score_std": score_std,
                "accuracy": acc,
                "accuracy_std": acc_std,
                "loss": loss,
                "loss_std": loss_std,
                "tasks": _task_spread(ok),
                **{k: _mean([r.get(k) for r in ok]) for k in (*STATS, "skipped_steps", "seconds")},
            }
        )
    return ordered(out, rank)


def task_names(rows: list[dict[str, Any]]) -> list[str]:
    """The tasks of a multi-task sweep, in the order the jobs name them."""
    return list(dict.fromkeys(k for r in rows for k in r.get("tasks") or {}))


def _task_spread(ok: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Task -> its metric and loss as mean and sample std over the group's jobs that ended ok."""
    out = {}
    for task in task_names(ok):
        values = [r["tasks"].get(task) or {} for r in ok]
        metric, metric_std = _spread([v["test_metric"] for v in values if v.get("test_metric") is not None])
        loss, loss_std = _spread([v["test_loss"] for v in values if v.get("test_loss") is not None])
        out[task] = {"metric": metric, "metric_std": metric_std, "loss": loss, "loss_std": loss_std}
    return out


def write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    tasks = [(t, f) for t in task_names(rows) for f in ("test_metric", "test_loss")]
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow([*COLUMNS, *(f"{t}/{field}" for t, field in tasks)])
        for r in rows:
            values = {
                **r,
                "overrides": " ".join(r["overrides"]),
                "seconds": None if r["seconds"] is None else round(r["seconds"], 3),
            }
            per_task = [(r["tasks"].get(t) or {}).get(field) for t, field in tasks]
            writer.writerow(["" if v is None else v for v in [*(values[c] for c in COLUMNS), *per_task]])


def _pm(mean: float | None, std: float | None, digits: int = 4) -> str:
    return "" if mean is None else f"{mean:.{digits}f}" + ("" if std is None else f" ± {std:.{digits}f}")


def _count_line(rows: list[dict[str, Any]]) -> str:
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    ok = counts.pop("ok", 0)
    rest = ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))
    return f"{len(rows)} jobs: {ok} ok" + (f", {rest}" if rest else "") + "."


def markdown(rows: list[dict[str, Any]], sweep_dir: str | Path = "", rank: Ranking | None = None) -> str:
    rank = rank or ranking(rows)
    shared, varying = _varying(rows)
    lines = [f"# Sweep {sweep_dir}".rstrip(), "", _count_line(rows), ""]
    if shared:
        lines += [f"Every job: `{' '.join(shared)}`", ""]
    private = any(r.get("epsilon") is not None for r in rows)  # a DP sweep: each job's epsilon
    lines += [
        "| job | overrides | status | test accuracy | test loss | "
        + ("epsilon | " if private else "")
        + "clip_coef | frac_clipped | total norm | skipped | seconds | error |",
        "|---|---|---|---:|---:|" + ("---:|" if private else "") + "---:|---:|---:|---:|---:|---|",
    ]
    for r, own in zip(rows, varying):
        epsilon = f"{_num(r.get('epsilon'), 3)} | " if private else ""
        lines.append(
            f"| {r['job']} | {_cell(' '.join(own))} | {r['status']} | {_num(r['test_accuracy'], 4)} | "
            f"{_num(r['test_loss'], 4)} | {epsilon}{_num(r['clip_coef'], 3)} | {_num(r['frac_clipped'], 3)} | "
            f"{_num(r['total_norm'], 3)} | {_num(r['skipped_steps'], 0)} | {_num(r['seconds'], 1)} | "
            f"{_cell(r['error'])} |"
        )
    groups = by_group(rows, rank)
    own = rank.metric not in ("accuracy", "loss")  # a column of its own for a task's number
    if len(groups) > 1 or any(g["ok"] > 1 for g in groups):
        lines += [
            "",
            "## Per group, over seeds",
            "",
            "Jobs that differ only in `seed=` form a group; mean ± sample std over the jobs that ended ok; "
            f"ranked by {rank.label} ({rank.better} is better; report.metric, report.direction).",
            "",
            "| group | jobs ok | " + (f"{rank.label} | " if own else "") + "test accuracy | test loss | clip_coef "
            "| frac_clipped | total norm | skipped | seconds |",
            "|---|---:|" + ("---:|" if own else "") + "---:|---:|---:|---:|---:|---:|---:|",
        ]
        for g in groups:
            score = f"{_pm(g['score'], g['score_std'])} | " if own else ""
            lines.append(
                f"| {_cell(g['group'])} | {g['ok']}/{g['jobs']} | {score}{_pm(g['accuracy'], g['accuracy_std'])} | "
                f"{_pm(g['loss'], g['loss_std'])} | {_num(g['clip_coef'], 3)} | "
                f"{_num(g['frac_clipped'], 3)} | {_num(g['total_norm'], 3)} | "
                f"{_num(g['skipped_steps'], 1)} | {_num(g['seconds'], 1)} |"
            )
        note = spread_note(groups, rank)
        lines += ["", note] if note else []
        lines += _task_table(groups, rows)
    return "\n".join(lines) + "\n"


def _task_table(groups: list[dict[str, Any]], rows: list[dict[str, Any]]) -> list[str]:
    """Per group, each task's test metric (any: accuracy, rmse, one's own) as mean ± std over seeds."""
    tasks = task_names(rows)
    if not tasks:
        return []
    names = {t: {((r.get("tasks") or {}).get(t) or {}).get("metric") for r in rows} - {None} for t in tasks}
    said = ", ".join(f"{t}: {' or '.join(sorted(n)) or 'its metric'}" for t, n in names.items())
    lines = [
        "",
        "## Per task, over seeds",
        "",
        f"Each task's test metric ({said}), mean ± sample std over the group's jobs that ended ok; "
        "a group's test accuracy above is the mean over its tasks when every task's metric is accuracy.",
        "",
        "| group | jobs ok | " + " | ".join(tasks) + " |",
        "|---|---:|" + "---:|" * len(tasks),
    ]
    for g in groups:
        cells = [_pm(g["tasks"].get(t, {}).get("metric"), g["tasks"].get(t, {}).get("metric_std")) for t in tasks]
        lines.append(f"| {_cell(g['group'])} | {g['ok']}/{g['jobs']} | " + " | ".join(cells) + " |")
    return lines


def write_report(
    sweep_dir: str | Path, *, ended: bool = False, metric: str = "auto", direction: str = "auto"
) -> tuple[dict[str, Path], list[dict[str, Any]]]:
    """Write the CSV, Markdown and PNG report into ``sweep_dir``; returns (paths, rows).
    ``ended``: the sweep is over (a job still recorded as running was killed); ``metric``,
    ``direction``: what ranks the groups (``report.metric``, ``report.direction``)."""
    from gradmod.reporting.plots import plot_sweep_curves

    root = Path(sweep_dir)
    if not root.is_dir():
        raise ValueError(f"sweep folder {str(root)!r} does not exist")
    rows = collect(root, ended=ended)
    if not rows:
        raise ValueError(
            f"no job folders under {str(root)!r} (looked for .gradmod/jobs/, .hydra/overrides.yaml and summary.json)"
        )
    rank = ranking(rows, metric, direction)
    paths = {kind: root / name for kind, name in FILES.items()}
    write_csv(rows, paths["csv"])
    paths["md"].write_text(markdown(rows, root, rank))
    _, varying = _varying(rows)
    plot_sweep_curves(rows, [group_of(own) for own in varying], [" ".join(own) for own in varying], paths["png"])
    return paths, rows
