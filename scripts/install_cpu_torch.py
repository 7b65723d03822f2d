"""Install CPU-only torch and torchvision, a pair that works together, and check it.

    python scripts/install_cpu_torch.py      # before pip install -e ., to skip the CUDA wheels

Where torch and torchvision already work together it changes nothing. Otherwise it takes
the CPU wheels from their own index (``--index-url https://download.pytorch.org/whl/cpu``),
and, for a pair that is there but broken, the torchvision built for the installed torch or a
release pair from pip's own indexes; each step is planned with a dry run first and taken only
where pip would install a pair of one release and one build, then checked in a fresh
interpreter (torchvision's compiled ``nms``), and undone if the check fails
(``gradmod.install.repair``). It ends with the pair and ``torch.version.cuda`` (``None`` on a
CPU build), or one line saying that no working pair could be made and that nothing was
changed, exit status 1. Nothing of gradmod but ``gradmod/install.py`` (no torch) is imported,
so it runs before ``pip install -e .``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

INSTALL = Path(__file__).resolve().parents[1] / "gradmod" / "install.py"  # the standard library's imports only


def install_module():
    """``gradmod/install.py`` of this checkout, loaded from its file: gradmod need not be installed."""
    spec = importlib.util.spec_from_file_location("gradmod_install", INSTALL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


if __name__ == "__main__":
    install = install_module()
    install.parse(
        sys.argv[1:], prog="python scripts/install_cpu_torch.py", cpu_flag=False
    )  # --help; an unknown flag: one line
    sys.exit(install.repair(cpu=True))
