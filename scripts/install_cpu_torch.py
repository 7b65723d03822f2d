"""Install CPU-only torch and torchvision, a pair that works together, and check it.

    python scripts/install_cpu_torch.py

1. ``pip install torch torchvision`` from the CPU wheels' index, failing fast where it cannot
   be reached (``--retries 1 --timeout 10``).
2. The check: in a fresh interpreter, import both and run torchvision's compiled ``nms``.
   A pip configured with other indexes (``extra-index-url``) may have taken torchvision from
   one of them, built for CUDA or for another torch: ``operator torchvision::nms does not
   exist``.
3. Then the torchvision built for the installed torch (``gradmod.install.fix_command``: the
   same release, from the index of torch's build), checked again.
4. Then both again, force-reinstalled as one release pair from pip's own indexes.

It ends with the pair it left and ``torch.version.cuda`` (``None`` on a CPU build), or, where
no step gave a working pair, one line saying so and exit status 1. Nothing of gradmod but
``gradmod/install.py`` (no torch) is imported, so it runs before ``pip install -e .``.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gradmod.install import WHEELS, fix_command, installed, matching_torchvision  # noqa: E402

CHECK = (
    "import torch, torchvision; torchvision.ops.nms(torch.zeros(0, 4), torch.zeros(0), 0.5); "
    "print(f'torch {torch.__version__}, torchvision {torchvision.__version__}, cuda {torch.version.cuda}')"
)
FIRST = f"pip install torch torchvision --index-url {WHEELS}/cpu --retries 1 --timeout 10"


def main(run: Callable[[list[str]], int] = lambda cmd: subprocess.run(cmd).returncode) -> int:
    """Each step in turn until the check passes; ``run`` runs a command (a test gives its own)."""
    python = [sys.executable, "-m"]
    steps = [lambda: FIRST, lambda: fix_command(installed("torch") or ""), _same_release]
    for step in steps:
        command = step()
        if command is None:
            continue
        print(f"+ {command}", flush=True)
        run([*python, *shlex.split(command)])
        if run([sys.executable, "-c", CHECK]) == 0:
            return 0
    print(
        f"error: no working torch/torchvision pair (torch {installed('torch')}, torchvision "
        f"{installed('torchvision')}); see docs/guide/usage.md#torch-without-a-gpu",
        file=sys.stderr,
    )
    return 1


def _same_release() -> str | None:
    """Both packages, one release pair without a build label, from pip's own indexes."""
    torch_version = (installed("torch") or "").partition("+")[0]
    vision = matching_torchvision(torch_version)
    if not torch_version or vision is None:
        return None
    return f"pip install --force-reinstall torch=={torch_version} torchvision=={vision}"


if __name__ == "__main__":
    sys.exit(main())
