"""Peak memory of the per_sample, per_loss and sharpness sections, measured before the
timings (the fresh processes start before this one grows, and a failure shows early)."""

from __future__ import annotations

import torch

from benchmarks.sections import per_loss, per_sample, sharpness


def per_sample_memory(log=print) -> dict[str, dict]:
    """Each per_sample contender's peak memory (fresh process each), and gradmod's over Opacus'."""
    peaks = {}
    for name in per_sample.names(hf=False):  # the HF models: time only
        peaks[name] = per_sample.peak_in_subprocess(name)
        log(f"  peak memory of {name}: {peaks[name] / 2**20:.1f} MiB", flush=True)
    out: dict[str, dict] = {"peak_bytes": peaks, "ratios": {}}
    for model in per_sample.MODELS:
        for other in ("opacus", "opacus_ghost"):
            if peaks.get(f"{model}.{other}", 0) > 0:
                value = peaks[f"{model}.gradmod"] / peaks[f"{model}.{other}"]
                out["ratios"][f"{model}_peak_over_{other}"] = {"value": value, "target": "< 1", "met": value < 1}
    return out


def per_loss_memory(log=print) -> dict[str, dict]:
    """Each per_loss contender's peak memory (fresh process each), and gradmod's over torchjd's."""
    peaks = {}
    for name in per_loss.peak_names():
        peaks[name] = per_loss.peak_in_subprocess(name)
        log(f"  peak memory of {name}: {peaks[name] / 2**20:.1f} MiB", flush=True)
    out: dict[str, dict] = {"peak_bytes": peaks, "ratios": {}}
    for name, value in peaks.items():
        model, contender = name.split(".")
        other = f"{model}.{contender.replace('gradmod_', 'torchjd_')}"
        if contender.startswith("gradmod_") and peaks.get(other, 0) > 0:
            r = value / peaks[other]
            out["ratios"][f"{model}_{contender}_peak_over_torchjd"] = {"value": r, "target": "< 1", "met": r < 1}
    return out


def measure(sections: list[str], device: torch.device, whole: bool) -> dict[str, dict]:
    """The peaks of the sections asked for, merged: ``peak_bytes`` and ``ratios``. ``whole``:
    every contender of the sections is timed (not a smoke run, no ``--only``); else none. The
    resident sets of fresh processes only on the CPU."""
    if not whole:
        return {}
    parts = []
    if "per_sample" in sections and device.type == "cpu":
        parts.append(per_sample_memory())
    if "per_loss" in sections and device.type == "cpu":
        parts.append(per_loss_memory())
    if "sharpness" in sections:
        parts.append(sharpness.memory(resident=device.type == "cpu", device=str(device)))
    if not parts:
        return {}
    return {
        "peak_bytes": {k: v for p in parts for k, v in p["peak_bytes"].items()},
        "ratios": {k: v for p in parts for k, v in p["ratios"].items()},
    }
