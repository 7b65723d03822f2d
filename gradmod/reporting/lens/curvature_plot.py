"""``curvature.png``: the top Hessian eigenvalue of each group as training goes, against 2/lr
(the edge of stability: gradient descent on a quadratic diverges where the curvature passes
2/lr), and the trace per group beside it where the rule took one."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from gradmod.reporting.plots import _save, plt


def plot_curvature(rows: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """``rows``: ``{step, lr, rule, group, top1, [trace]}`` per estimate and group."""
    traced = any(r.get("trace") is not None for r in rows)
    fig, axes = plt.subplots(1, 2 if traced else 1, figsize=(11 if traced else 6.5, 4), squeeze=False)
    top, series = axes[0][0], _by_group(rows)
    for label, rs in series.items():
        top.plot([r["step"] for r in rs], [r["top1"] for r in rs], marker=".", label=label)
    edge = sorted({(r["step"], 2 / r["lr"]) for r in rows if r.get("lr")})
    if edge:
        top.plot([s for s, _ in edge], [e for _, e in edge], "k--", label="2/lr")
    top.set_xlabel("optimizer step")
    top.set_ylabel("top Hessian eigenvalue")
    top.set_title("sharpness against the edge of stability")
    top.legend(fontsize=7)
    if traced:
        ax = axes[0][1]
        for label, rs in series.items():
            kept = [r for r in rs if r.get("trace") is not None]
            ax.errorbar(
                [r["step"] for r in kept],
                [r["trace"] for r in kept],
                yerr=[r.get("trace_se") or 0 for r in kept],
                marker=".",
                label=label,
            )
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("Hessian trace (Hutchinson, +- 1 s.e.)")
        ax.set_title("trace per group")
        ax.legend(fontsize=7)
    fig.tight_layout()
    _save(fig, path, dpi=100)
    plt.close(fig)
    return Path(path)


def _by_group(rows: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    rules = {r["rule"] for r in rows}
    out: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        label = r["group"] if len(rules) == 1 else f"{r['rule']}/{r['group']}"
        out.setdefault(label, []).append(r)
    return out
