"""Whether the installed torch and torchvision work together, and the command that makes them.

torchvision's compiled operators are built against one torch build: a CPU torch beside a
torchvision built for CUDA (or for another torch release), as a pip configured with more
than one index can leave them, fails at ``import torchvision`` with ``operator
torchvision::nms does not exist``. ``checked_torchvision()`` imports it and turns such a
failure into one line (``BrokenInstall``) naming both versions and the pip command that
installs the matching torchvision; ``scripts/install_cpu_torch.py`` installs the CPU pair
and checks it the same way. Only package metadata is read here: no torch import.
"""

from __future__ import annotations

import re
from importlib import metadata
from types import ModuleType

WHEELS = "https://download.pytorch.org/whl"


class BrokenInstall(ImportError):
    """torch and torchvision that do not work together (one line: what, and the fix)."""


def gradmod_version() -> str:
    from gradmod import __version__  # the package's own attribute: no torch

    return __version__


def installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def matching_torchvision(torch_version: str) -> str | None:
    """The torchvision release built for ``torch_version`` (torch 2.M.P pairs with 0.(M+15).P
    since 2.0; the local label, ``+cpu`` or ``+cu126``, is the build's), None if unknown."""
    m = re.fullmatch(r"2\.(\d+)\.(\d+)(\+[\w.]+)?", torch_version)
    if not m:
        return None
    return f"0.{int(m.group(1)) + 15}.{m.group(2)}{m.group(3) or ''}"


def fix_command(torch_version: str) -> str:
    """The pip command that installs the torchvision matching ``torch_version``, from the
    index its build comes from (its local label: ``+cpu`` -> the CPU wheels)."""
    wanted = matching_torchvision(torch_version)
    if wanted is None:
        return "pip install --force-reinstall torch torchvision (one release pair, from one index)"
    release, _, label = wanted.partition("+")
    index = f" --index-url {WHEELS}/{label}" if label else ""
    return f"pip install --force-reinstall --no-deps torchvision=={release}{index}"


def explain(error: BaseException) -> str:
    torch_v, vision_v = installed("torch") or "?", installed("torchvision") or "?"
    first = " ".join(str(error).split())[:160]
    return (
        f"torch {torch_v} and torchvision {vision_v} do not work together ({type(error).__name__}: {first}); "
        f"install the torchvision built for this torch: {fix_command(torch_v)}"
    )


def checked_torchvision() -> ModuleType:
    """``import torchvision``, or ``BrokenInstall`` in one line where its operators do not
    load against this torch (a missing torchvision stays the plain ImportError)."""
    try:
        import torchvision
    except ModuleNotFoundError as e:
        if e.name == "torchvision":
            raise
        raise BrokenInstall(explain(e)) from None
    except (RuntimeError, ImportError, AttributeError, OSError) as e:
        raise BrokenInstall(explain(e)) from None
    return torchvision
