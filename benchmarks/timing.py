"""The clock of ``python -m benchmarks``: every contender timed in one process, and the
ratios of two contenders formed from those timings.

Each repeat runs every contender once, in an order that rotates from repeat to repeat and
runs backwards every other repeat (so slow drifts of the machine hit all of them alike, and
no contender always runs right after another); a contender's time is the median of its
repeats, and a ratio divides two medians measured in this same process, but for the few
ratios of two contenders on one model instance, formed from the repeats' own ratios
(``paired_ratio``).
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from typing import Callable

import torch

Setup = Callable[[], Callable[[], None]]  # a contender's set-up (untimed), returning its timed run
Contenders = dict[str, tuple[Setup, int, str]]  # name -> (set-up, items per run, item unit)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(
    contenders: Contenders,
    device: torch.device,
    repeats: int,
    warmup: int,
    unit_images: dict[str, int],
    log=print,
) -> dict[str, dict]:
    """Every contender's wall and CPU seconds per run, ``warmup`` untimed repeats first;
    ``unit_images``: the images in one item of a unit (a step of batch 100: 100)."""
    runs = {name: setup() for name, (setup, _, _) in contenders.items()}
    gc.collect()
    gc.freeze()  # set-up objects out of the collector's way: collecting before each run is then cheap
    names = list(runs)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}  # the process's CPU time: steadier on a shared machine
    for r in range(-warmup, repeats):
        shift = r % len(names)
        order = names[shift:] + names[:shift]  # rotate the order each repeat
        if r % 2:  # and run it backwards every other one: each runs before its neighbour as often as after
            order.reverse()
        for name in order:
            gc.collect()
            sync(device)
            t0, c0 = time.perf_counter(), time.process_time()
            runs[name]()
            sync(device)
            if r >= 0:
                seconds[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
        log(f"  {'warm-up' if r < 0 else f'repeat {r + 1}/{repeats}'} done", flush=True)
    gc.unfreeze()
    return {name: _result(name, s, cpu[name], contenders[name], device, unit_images) for name, s in seconds.items()}


def _result(name: str, s: list[float], cpu: list[float], contender, device: torch.device, unit_images) -> dict:
    _, items, unit = contender
    med = statistics.median(s)
    return {
        "section": name.split(".")[0],
        "seconds": s,
        "median_s": med,
        "min_s": min(s),
        "max_s": max(s),
        "cpu_seconds": cpu,
        "median_cpu_s": statistics.median(cpu),
        "items": items,
        "unit": unit,
        "device": device.type,
        "per_item_ms": 1000 * med / items,
        "images_per_s": items * unit_images.get(unit, 1) / med,
    }


def clock(result: dict) -> str:
    """The median a ratio divides: the per_loss section's single-threaded steps, and the
    sharpness, sam_peers, freeze, orthogonalize, scores, curvature and influence sections' on the CPU, compare CPU time (on a shared machine
    wall time mostly measures the neighbours); the rest wall time."""
    if result["section"] == "per_loss" and result["unit"] == "mtl_step":
        return "median_cpu_s"
    on_cpu = result.get("device") == "cpu"
    return (
        "median_cpu_s"
        if result["section"]
        in ("sharpness", "sam_peers", "freeze", "orthogonalize", "scores", "curvature", "influence")
        and on_cpu
        else "median_s"
    )


def paired_ratio(num: list[float], den: list[float]) -> float:
    """Two contenders on one model instance: the repeats' own ratios (the drifts they share
    cancel), the median of those run forwards times that of those run backwards, square-rooted
    (whichever runs second finds the instance in the caches: about 10% on the MLPs here)."""
    r = [a / b for a, b in zip(num, den)]
    forwards, backwards = r[0::2], r[1::2]  # measure() runs every other repeat backwards
    return math.sqrt(statistics.median(forwards) * statistics.median(backwards)) if backwards else r[0]
