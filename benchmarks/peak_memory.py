"""Peak memory of one benchmark contender: the growth of the resident set's high-water
mark over its steps, in a fresh process so one contender's peak cannot hide another's
(Linux: /proc/self/status, the mark reset through /proc/self/clear_refs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def peak(run: Callable[[], None]) -> int:
    """Bytes the peak resident set grows by while ``run`` (already set up) runs."""
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = status_kib("VmRSS")
    run()
    return (status_kib("VmHWM") - before) * 1024


ROOT = Path(__file__).resolve().parents[1]  # the checkout that holds benchmarks/


def in_subprocess(module: str, name: str) -> int:
    """``python -m module --peak name`` (which prints ``{"peak_bytes": n}`` last), read back;
    run from the checkout, so that ``module`` and gradmod are this checkout's."""
    out = subprocess.run(
        [sys.executable, "-m", module, "--peak", name],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
        env={"OMP_NUM_THREADS": "1", **os.environ},
    )
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_bytes"]


def main(doc: str, peak: Callable[[str], int]) -> None:
    """A section module's command line: ``--peak NAME`` prints that contender's peak (one
    thread) as ``in_subprocess`` reads it; anything else prints the module's ``doc``."""
    if len(sys.argv) == 3 and sys.argv[1] == "--peak":
        import torch

        torch.set_num_threads(1)
        print(json.dumps({"peak_bytes": peak(sys.argv[2])}))
    else:
        print(doc)


def live_tensor_peak(run: Callable[[], None]) -> int:
    """Bytes of the tensors ``run`` allocates that are alive together at most, counted by a
    dispatch mode (every op's outputs, backward's too, until their storage is freed): the
    allocator's view, as CUDA's max_memory_allocated, deterministic on any device and free
    of the heap's fragmentation that the resident set also shows."""
    import weakref

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class Live(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.live = self.peak = 0
            self.sizes: dict[int, int] = {}

        def _free(self, key: int) -> None:
            self.live -= self.sizes.pop(key)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    storage = t.untyped_storage()
                    if id(storage) not in self.sizes:
                        self.sizes[id(storage)] = storage.nbytes()
                        self.live += storage.nbytes()
                        self.peak = max(self.peak, self.live)
                        weakref.finalize(storage, self._free, id(storage))
            return out

    with Live() as live:
        run()
    return live.peak
