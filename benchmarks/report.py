"""What ``python -m benchmarks`` prints and records besides the timings: the machine, and
the table of every contender and ratio."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch

from benchmarks.timing import clock
from gradmod.run import host_heap

BASE = {"epoch": "epoch.floor", "eval": "eval.gradmod", "step": "step.none"}  # else the model's ``plain``


def machine(device: torch.device) -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torchvision

    info = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "host_heap": "keep" if host_heap.kept else "release",
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": str(device),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def table(results: dict[str, dict], rat: dict[str, dict]) -> str:
    """Every contender's times beside its ratio to its section's base (``x base``), then every ratio."""
    lines = [
        f"{'contender':<28} {'median s':>9} {'min s':>8} {'max s':>8} {'cpu s':>8} {'per item':>16} {'images/s':>9} "
        f"{'x base':>7}"
    ]
    for name, r in results.items():
        b = results.get(BASE.get(r["section"]) or f"{name.rpartition('.')[0]}.plain")
        key = clock(r)
        x = f"{r[key] / b[key]:.3f}" if b else "-"
        lines.append(
            f"{name:<28} {r['median_s']:>9.3f} {r['min_s']:>8.3f} {r['max_s']:>8.3f} {r['median_cpu_s']:>8.3f} "
            f"{r['per_item_ms']:>8.3f} ms/{r['unit']:<7} {r['images_per_s']:>9.0f} {x:>7}"
        )
    lines.append("")
    lines.append(f"{'ratio':<34} {'value':>7}  target")
    for name, r in rat.items():
        verdict = "" if "target" not in r else f"{r['target']}: {'met' if r['met'] else 'NOT met'}"
        lines.append(f"{name:<34} {r['value']:>7.3f}  {verdict}")
    return "\n".join(lines)


def memory_lines(memory: dict) -> list[str]:
    """One line per peak-memory ratio, with its target."""
    return [
        f"{name:<34} {r['value']:>7.3f}  {r['target']}: {'met' if r['met'] else 'NOT met'}"
        for name, r in memory.get("ratios", {}).items()
    ]
