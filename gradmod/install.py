"""Whether the installed torch and torchvision work together, and a repair that checks
each step before it changes anything.

torchvision's compiled operators are built against one torch build: a CPU torch beside a
torchvision built for CUDA (or for another torch release), as a pip configured with more
than one index can leave them, fails at ``import torchvision`` with ``operator
torchvision::nms does not exist``. ``checked_torchvision()`` imports it and turns such a
failure into one line (``BrokenInstall``) naming both versions and the command that repairs
them, ``python -m gradmod.install``. ``repair`` (that command, and
``scripts/install_cpu_torch.py`` with ``cpu=True``) changes nothing where the pair works;
otherwise it tries its steps in turn: the CPU wheels (``cpu``), the torchvision built for the
installed torch, a release pair from pip's own indexes. Each step is planned first (``pip
install --dry-run --report``) and taken only where pip would install a pair of one release
and one build; the pair it leaves is checked in a fresh interpreter, and a step whose pair
fails that check is undone (the versions found are put back). Only package metadata is read
here: no torch import.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path
from types import ModuleType
from typing import Callable

WHEELS = "https://download.pytorch.org/whl"
REPAIR = "python -m gradmod.install"
# The check of a pair, in a fresh interpreter: both import, and torchvision's compiled nms runs.
CHECK = """
try:
    import torch, torchvision
    torchvision.ops.nms(torch.zeros(0, 4), torch.zeros(0), 0.5)
except Exception as e:
    raise SystemExit(f"not a working pair: {type(e).__name__}: {' '.join(str(e).split())[:200]}")
print(f"torch {torch.__version__}, torchvision {torchvision.__version__}, cuda {torch.version.cuda}: they work together")
"""
FAST = ["--retries", "1", "--timeout", "10"]  # an index that cannot be reached fails in seconds
Pair = tuple["str | None", "str | None"]  # the (torch, torchvision) versions, build labels included
Run = Callable[[list[str]], int]


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


def one_build(pair: Pair) -> bool:
    """Whether ``pair`` is of one release and one build: the torchvision made for that torch,
    with the same label (``+cpu``, ``+cu126``; none for PyPI's builds)."""
    torch_version, vision = pair
    return bool(torch_version and vision) and matching_torchvision(torch_version or "") == vision


def explain(error: BaseException) -> str:
    torch_v, vision_v = installed("torch") or "?", installed("torchvision") or "?"
    first = " ".join(str(error).split())[:160]
    return (
        f"torch {torch_v} and torchvision {vision_v} do not work together ({type(error).__name__}: {first}); "
        f"to repair them (each step checked before it changes anything): {REPAIR}"
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


def _run(command: list[str]) -> int:
    return subprocess.run(command).returncode


def repair(cpu: bool = False, run: Run = _run) -> int:
    """Leave a working torch/torchvision pair, or none changed (see the module's docstring);
    returns the exit status. ``run`` runs a command (a test gives its own)."""
    found: Pair = (installed("torch"), installed("torchvision"))
    if run([sys.executable, "-c", CHECK]) == 0:
        print("nothing changed")
        return 0
    pip = installed("pip") or "0"
    if tuple(int(n) for n in re.findall(r"\d+", pip)[:2]) < (22, 2):
        print(
            f"error: pip {pip} cannot plan an install (--dry-run --report); first: python -m pip install -U pip",
            file=sys.stderr,
        )
        return 1
    for why, args, wanted in _steps(cpu, found):
        planned = _plan(args, run)
        if planned is None or not wanted(planned):
            print(
                f"- {why}: not to be had here"
                + (f" (pip would take torch {planned[0]}, torchvision {planned[1]})" if planned else "")
            )
            continue
        print(f"+ pip {' '.join(args)}", flush=True)
        if run(_pip(args)) == 0 and run([sys.executable, "-c", CHECK]) == 0:
            return 0
        _put_back(found, run)
    then = "pip install -e . installs PyPI's pair (a CUDA build, which runs on the CPU); " if found[0] is None else ""
    print(
        f"error: no working torch/torchvision pair could be made here; nothing changed (torch {found[0]}, "
        f"torchvision {found[1]}); {then}see docs/guide/usage.md#torch-without-a-gpu",
        file=sys.stderr,
    )
    return 1


def _steps(cpu: bool, found: Pair) -> list[tuple[str, list[str], Callable[[Pair], bool]]]:
    """(what, pip's arguments, the planned pair it must give), in the order tried."""
    steps: list[tuple[str, list[str], Callable[[Pair], bool]]] = []
    if cpu:
        cpu_pair = ["install", "--upgrade", "torch", "torchvision", "--index-url", f"{WHEELS}/cpu", *FAST]
        steps.append(("the CPU wheels", cpu_pair, lambda p: one_build(p) and (p[0] or "").endswith("+cpu")))
    torch_version = found[0]
    wanted = matching_torchvision(torch_version or "")
    if torch_version is None or wanted is None:
        return steps  # no torch to repair around: pip install -e . picks a pair
    label = wanted.partition("+")[2]
    index = ["--index-url", f"{WHEELS}/{label}", *FAST] if label else []
    own = ["install", "--no-deps", f"torchvision=={wanted}", *index]  # the label pinned: that build or none
    steps.append(("the torchvision built for this torch", own, lambda p: p == (torch_version, wanted)))
    steps.append(("a release pair from pip's own indexes", ["install", "--upgrade", "torch", "torchvision"], one_build))
    return steps


def _pip(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "pip", *args]


def _plan(args: list[str], run: Run) -> Pair | None:
    """The pair ``pip`` with ``args`` would leave (a dry run; None where pip cannot plan it)."""
    with tempfile.TemporaryDirectory() as folder:
        report = Path(folder) / "report.json"
        if run(_pip([args[0], "--dry-run", "-qq", "--report", str(report), *args[1:]])) != 0 or not report.exists():
            return None
        chosen = {
            item["metadata"]["name"].lower(): item["metadata"]["version"]
            for item in json.loads(report.read_text())["install"]
        }
    return chosen.get("torch", installed("torch")), chosen.get("torchvision", installed("torchvision"))


def _put_back(found: Pair, run: Run) -> None:
    """The versions found before a step whose pair failed the check."""
    for name, version in zip(("torch", "torchvision"), found):
        if installed(name) == version:
            continue
        print(f"+ putting back {name} {version}", flush=True)
        run(
            _pip(
                ["uninstall", "-y", name]
                if version is None
                else ["install", "--no-deps", "--force-reinstall", f"{name}=={version}"]
            )
        )


if __name__ == "__main__":
    sys.exit(repair(cpu="--cpu" in sys.argv[1:]))
