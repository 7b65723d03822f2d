"""Sweeps: the report a multirun leaves in its folder, and the pieces jobs need for it.

At the end of ``python train.py -m ...`` the ``SweepReport`` callback (``gradmod.app.sweep_callback``,
registered in ``conf/config.yaml`` under ``hydra.callbacks``) reads every job folder of the sweep and
writes, into the sweep folder:

* ``sweep.csv``: one row per job: job, overrides, status, test_accuracy, test_loss,
  seconds, error;
* ``sweep.md``: the same table in Markdown (the overrides that differ between jobs; the
  shared ones above the table), then the mean and spread over seeds per setting;
* ``sweep_accuracy.png``: every job's test accuracy per epoch.

A job's row comes from its ``summary.json`` (status ``ok`` or ``failed`` with the error),
``metrics.jsonl`` (the curve) and ``.hydra/overrides.yaml``; a folder without a summary
is ``incomplete`` (killed, or still running). ``python scripts/sweep_report.py PATH``
rebuilds the report for an existing sweep folder.
"""

from __future__ import annotations

import csv
import json
import logging
import statistics
from pathlib import Path
from typing import Any, Mapping

import yaml

log = logging.getLogger(__name__)

COLUMNS = ("job", "overrides", "status", "test_accuracy", "test_loss", "seconds", "error")
FILES = {"csv": "sweep.csv", "md": "sweep.md", "png": "sweep_accuracy.png"}


# --- what jobs write -------------------------------------------------------------------


def launcher_threads(launcher: Mapping[str, Any] | None, cores: int | None = None) -> int:
    """Torch threads for one job of a sweep: ``cores // n_jobs`` under the joblib launcher
    (which runs ``n_jobs`` jobs at once; -1 is every core, -2 all but one, as in joblib),
    0 (torch's default) for launchers that run one job at a time on this machine."""
    target = str((launcher or {}).get("_target_", ""))
    if not target.endswith("JoblibLauncher"):
        return 0
    if cores is None:
        import joblib

        cores = joblib.cpu_count()
    n_jobs = int(launcher.get("n_jobs") or -1)
    if n_jobs < 0:
        n_jobs = max(1, cores + 1 + n_jobs)
    if n_jobs > cores:
        log.warning("hydra.launcher.n_jobs=%d is more than the %d cores: the jobs share them; "
                    "set hydra.launcher.n_jobs=%d or fewer", n_jobs, cores, cores)
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


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def read_job(job_dir: Path, root: Path) -> dict[str, Any]:
    """One job's row plus its accuracy curve (``curve``: [(epoch, test_accuracy)])."""
    overrides_file = job_dir / ".hydra" / "overrides.yaml"
    overrides = [str(o) for o in yaml.safe_load(overrides_file.read_text()) or []] if overrides_file.exists() else []
    summary = _read_json(job_dir / "summary.json")
    curve = []
    metrics = job_dir / "metrics.jsonl"
    if metrics.exists():
        for line in metrics.read_text().splitlines():
            try:
                rec = json.loads(line)
                curve.append((rec["epoch"], rec["test_accuracy"]))
            except (ValueError, KeyError):
                continue  # a line cut short by a killed job
    if summary is None:
        summary = {"status": "incomplete", "error": "no summary.json (killed, or still running)"}
    return {
        "job": job_dir.relative_to(root).as_posix(),
        "overrides": overrides,
        "status": summary.get("status", "ok"),
        "test_accuracy": summary.get("test_accuracy"),
        "test_loss": summary.get("test_loss"),
        "seconds": summary.get("seconds"),
        "error": summary.get("error") or "",
        "curve": curve,
    }


def collect(sweep_dir: str | Path) -> list[dict[str, Any]]:
    root = Path(sweep_dir)
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


def _setting(overrides: list[str]) -> str:
    return " ".join(o for o in overrides if not o.startswith("seed=")) or "(all)"


def by_setting(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mean and spread of the final test accuracy over seeds, per setting (the overrides
    other than ``seed=``); only settings with at least one finished job."""
    groups: dict[str, list[dict[str, Any]]] = {}
    _, varying = _varying(rows)
    for row, own in zip(rows, varying):
        key = _setting(own)
        groups.setdefault(key, []).append(row)
    out = []
    for key, group in groups.items():
        acc = [r["test_accuracy"] for r in group if r["status"] == "ok" and r["test_accuracy"] is not None]
        if acc:
            out.append({"setting": key, "jobs": len(group), "ok": len(acc), "mean": statistics.fmean(acc),
                        "std": statistics.stdev(acc) if len(acc) > 1 else 0.0, "min": min(acc), "max": max(acc)})
    return out


def write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(COLUMNS)
        for r in rows:
            writer.writerow([r["job"], " ".join(r["overrides"]), r["status"],
                             "" if r["test_accuracy"] is None else r["test_accuracy"],
                             "" if r["test_loss"] is None else r["test_loss"],
                             "" if r["seconds"] is None else round(r["seconds"], 3), r["error"]])


def markdown(rows: list[dict[str, Any]], sweep_dir: str | Path = "") -> str:
    shared, varying = _varying(rows)
    failed = sum(r["status"] != "ok" for r in rows)
    lines = [f"# Sweep {sweep_dir}".rstrip(), "",
             f"{len(rows)} jobs: {len(rows) - failed} ok, {failed} failed or incomplete.", ""]
    if shared:
        lines += [f"Every job: `{' '.join(shared)}`", ""]
    lines += ["| job | overrides | status | test accuracy | test loss | seconds | error |",
              "|---|---|---|---:|---:|---:|---|"]
    for r, own in zip(rows, varying):
        lines.append(f"| {r['job']} | {_cell(' '.join(own))} | {r['status']} | {_num(r['test_accuracy'], 4)} | "
                     f"{_num(r['test_loss'], 4)} | {_num(r['seconds'], 1)} | {_cell(r['error'])} |")
    settings = by_setting(rows)
    if any(s["ok"] > 1 for s in settings):
        lines += ["", "## Per setting, over seeds", "",
                  "| setting | jobs ok | mean accuracy | std | min | max |", "|---|---:|---:|---:|---:|---:|"]
        for s in sorted(settings, key=lambda s: -s["mean"]):
            lines.append(f"| {_cell(s['setting'])} | {s['ok']}/{s['jobs']} | {s['mean']:.4f} | {s['std']:.4f} | "
                         f"{s['min']:.4f} | {s['max']:.4f} |")
    return "\n".join(lines) + "\n"


def plot_accuracy(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    _, varying = _varying(rows)
    settings = list(dict.fromkeys(_setting(own) for own in varying))  # one colour per setting:
    colors = plt.get_cmap("tab10" if len(settings) <= 10 else "tab20").colors  # seeds share it
    fig, ax = plt.subplots(figsize=(9, 5))
    for r, own in zip(rows, varying):
        if r["curve"]:
            epochs, acc = zip(*r["curve"])
            label = f"{r['job']}: {' '.join(own)}" + ("" if r["status"] == "ok" else f" ({r['status']})")
            ax.plot(epochs, acc, marker="o", linestyle="-" if r["status"] == "ok" else ":", label=label,
                    color=colors[settings.index(_setting(own)) % len(colors)])
    ax.set(xlabel="epoch", ylabel="test accuracy", title=f"test accuracy per job ({len(rows)} jobs)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize="small", loc="center left", bbox_to_anchor=(1.01, 0.5))
    else:
        ax.text(0.5, 0.5, "no job finished an epoch", ha="center", va="center", transform=ax.transAxes)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


def write_report(sweep_dir: str | Path) -> tuple[dict[str, Path], list[dict[str, Any]]]:
    """Write the CSV, Markdown and PNG report into ``sweep_dir``; returns (paths, rows)."""
    root = Path(sweep_dir)
    if not root.is_dir():
        raise ValueError(f"sweep folder {str(root)!r} does not exist")
    rows = collect(root)
    if not rows:
        raise ValueError(f"no job folders under {str(root)!r} (looked for .hydra/overrides.yaml and summary.json)")
    paths = {kind: root / name for kind, name in FILES.items()}
    write_csv(rows, paths["csv"])
    paths["md"].write_text(markdown(rows, root))
    plot_accuracy(rows, paths["png"])
    return paths, rows
