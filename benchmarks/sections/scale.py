"""The ``scale`` section of ``python -m benchmarks``: how the cost of each rule grows with the model.

Five MLPs, ``L x w``: L blocks of ``Linear(w, w)`` + ReLU and a 10-way head, batch 32, SGD
(lr 0.01), one fixed batch, every rule on ``*``. One optimizer step of each contender:

    bare              forward, backward, SGD step; nothing attached
    clamp_hook        clamp to [-0.01, 0.01] at the hook stage
    clamp_fused       the same at the fused stage
    log_hook          log at the hook stage
    log_fused         log at the fused stage
    clip_logged       log, clamp, log at the hook stage
    global_norm_clip  global_norm_clip(max_norm=1), fused
    agc               agc() (its defaults), fused
    zclip             zclip() (its defaults), fused

Every contender keeps its statistics every step and reads them every 50 steps
(``read_stats``), as the trainer does at its log points with the default (csv) logger. All
contenders of one shape run in one process, in runs of ``RUN_STEPS`` steps, the order
rotating from round to round; a contender's time is the median of its runs, a ratio divides
two such medians. Times are the thread's CPU time (``time.thread_time``; one torch thread,
so all of the step's work), which a shared machine's other processes inflate far less than
the wall clock; the wall-clock medians are recorded beside them. Denormal floats are flushed (``torch.set_flush_denormal``):
the deep models' gradients shrink through the denormal range, where CPU arithmetic is slow
for the bare step as much as for the rules, and would hide what the rules cost. Freed memory
is kept by the allocator (``keep_freed_memory``), so that page faults do not land at random.

    python -m benchmarks.sections.scale --rounds 3    # this section alone (python -m benchmarks scale)
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import gc
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from gradmod.hooks import attach
from gradmod.testing.opcount import OpCounter

SHAPES = ((4, 64), (50, 64), (200, 64), (200, 16), (8, 1024))  # (blocks, width)
BATCH, LR, READ_EVERY, RUN_STEPS = 32, 0.01, 50, 10
WARM_STEPS = 30  # past zclip's 25 warm-up steps, so its ops are counted as it runs from then on
CLAMP = {"name": "clamp", "min": -0.01, "max": 0.01}
CONTENDERS: dict[str, tuple[list, str] | None] = {  # name -> (transforms on "*", stage)
    "bare": None,
    "clamp_hook": ([CLAMP], "hook"),
    "clamp_fused": ([CLAMP], "fused"),
    "log_hook": (["log"], "hook"),
    "log_fused": (["log"], "fused"),
    "clip_logged": (["log", CLAMP, "log"], "hook"),
    "global_norm_clip": ([{"name": "global_norm_clip", "max_norm": 1.0}], "fused"),
    "agc": (["agc"], "fused"),
    "zclip": (["zclip"], "fused"),
}
# contender -> (ratio to bare it must stay within); every row
TARGETS = {
    "clamp_hook": 1.10,
    "clamp_fused": 1.03,
    "log_hook": 1.3,
    "log_fused": 1.3,
    "clip_logged": 1.4,
    "global_norm_clip": 1.10,
    "agc": 1.10,
    "zclip": 1.10,
}


def mlp(blocks: int, width: int) -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(blocks):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


class Contender:
    """One contender's model, optimizer and hooks, stepping on one fixed batch."""

    def __init__(self, name: str, init: nn.Module, x: torch.Tensor, y: torch.Tensor):
        self.model = copy.deepcopy(init)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=LR)
        spec = CONTENDERS[name]
        rules = {} if spec is None else {name: {"params": "*", "transforms": spec[0]}}
        self.hooks = attach(self.model, rules, stage="hook" if spec is None else spec[1])
        self.watch = bool(self.hooks.observers())
        self.x, self.y, self.steps = x, y, 0

    def step(self) -> None:
        self.steps += 1
        self.opt.zero_grad(set_to_none=True)
        F.cross_entropy(self.model(self.x), self.y).backward()
        if self.hooks.stage("fused") is not None:
            self.hooks.after_backward()
        self.opt.step()
        if self.watch and self.steps % READ_EVERY == 0:
            self.hooks.read_stats()

    def run(self, steps: int) -> None:
        for _ in range(steps):
            self.step()


def ops_per_step(c: Contender) -> int:
    """Aten ops of one step that does not read (the 49 steps of 50)."""
    while (c.steps + 1) % READ_EVERY in (0, 1):
        c.step()
    with OpCounter() as ops:
        c.step()
    return ops.count


def measure_shape(blocks: int, width: int, rounds: int, run_steps: int, log=print) -> dict:
    torch.manual_seed(0)
    init = mlp(blocks, width)
    x, y = torch.randn(BATCH, width), torch.randint(0, 10, (BATCH,))
    contenders = {name: Contender(name, init, x, y) for name in CONTENDERS}
    for c in contenders.values():
        c.run(WARM_STEPS)
    ops = {name: ops_per_step(c) for name, c in contenders.items()}  # in the steady state
    names = list(contenders)
    seconds: dict[str, list[float]] = {n: [] for n in names}
    wall: dict[str, list[float]] = {n: [] for n in names}
    gc.collect()
    gc.disable()  # a collection inside one contender's run would charge it alone
    try:
        for r in range(rounds):
            shift = r % len(names)
            for name in names[shift:] + names[:shift]:
                t0, w0 = time.thread_time(), time.perf_counter()
                contenders[name].run(run_steps)
                seconds[name].append((time.thread_time() - t0) / run_steps)
                wall[name].append((time.perf_counter() - w0) / run_steps)
    finally:
        gc.enable()
    bare = statistics.median(seconds["bare"])
    tensors = len(list(init.parameters()))
    rows = {}
    for name in names:
        med = statistics.median(seconds[name])
        rows[name] = {
            "ms": 1000 * med,
            "x_bare": med / bare,
            "ops": ops[name],
            "ops_over_bare": ops[name] - ops["bare"],
            "wall_ms": 1000 * statistics.median(wall[name]),
            "runs_ms": [1000 * s for s in seconds[name]],
        }
        if name in TARGETS:
            rows[name].update(target=TARGETS[name], met=med / bare <= TARGETS[name])
    log(f"  scale {blocks}x{width} ({tensors} tensors) done", flush=True)
    return {"blocks": blocks, "width": width, "tensors": tensors, "contenders": rows}


def keep_freed_memory() -> bool:
    """Ask glibc to keep freed blocks instead of returning them to the OS: by default a
    freed multi-megabyte block (a gradient, an activation) goes back, and the next one is
    faulted in page by page, thousands of page faults per step that land on whichever
    contender allocates next. The bare step pays them as much as the rules. False where
    the C library is not glibc (nothing changed)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(-3, 1 << 30) and libc.mallopt(-1, 1 << 30))  # M_MMAP_, M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        return False


def measure(rounds: int, run_steps: int = RUN_STEPS, shapes=SHAPES, log=print) -> dict:
    """Every shape's table, on one torch thread with denormals flushed and freed memory
    kept (see the module's note and ``keep_freed_memory``)."""
    kept = keep_freed_memory()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    try:
        out = {f"{b}x{w}": measure_shape(b, w, rounds, run_steps, log) for b, w in shapes}
    finally:
        torch.set_flush_denormal(False)
        torch.set_num_threads(threads)
    return {
        "batch": BATCH,
        "read_every": READ_EVERY,
        "run_steps": run_steps,
        "rounds": rounds,
        "threads": 1,
        "clock": "thread_time",
        "freed_memory_kept": kept,
        "shapes": out,
    }


def table(scale: dict) -> str:
    """Per shape: bare ms, then each contender's ratio to bare and ops over bare."""
    names = list(CONTENDERS)
    head = f"{'scale L x w (tensors)':<22} {'bare ms':>8} " + " ".join(f"{n:>16}" for n in names[1:])
    lines = [head, f"{'':<22} {'ops':>8} " + " ".join(f"{'x bare / +ops':>16}" for _ in names[1:])]
    for key, s in scale["shapes"].items():
        rows = s["contenders"]
        cells = []
        for n in names[1:]:
            mark = "" if rows[n].get("met", True) else "!"
            cells.append(f"{rows[n]['x_bare']:.2f}x{mark} +{rows[n]['ops_over_bare']}".rjust(16))
        lines.append(f"{key + ' (' + str(s['tensors']) + ')':<22} {rows['bare']['ms']:>8.2f} " + " ".join(cells))
        lines.append(f"{'':<22} {rows['bare']['ops']:>8} ")
    lines.append("(! = over its target: " + ", ".join(f"{n} {t}x" for n, t in TARGETS.items()) + ")")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=15, help="timed runs of every contender per shape (default 15)")
    p.add_argument("--run-steps", type=int, default=RUN_STEPS, help=f"steps per timed run (default {RUN_STEPS})")
    p.add_argument("--shapes", default=",".join(f"{b}x{w}" for b, w in SHAPES), help="comma-separated LxW")
    args = p.parse_args(argv)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    scale = measure(args.rounds, args.run_steps, shapes)
    print(table(scale))
    return scale


if __name__ == "__main__":
    main()
