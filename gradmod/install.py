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
and one build; a step that changes torch's build (a CPU torch for PyPI's CUDA one) says so
in one line before it installs; the pair it leaves is checked in a fresh interpreter, and a
step whose pair fails that check is undone (the versions found are put back). What pip says
while planning is held, and shown only where no working pair could be made. Only package
metadata is read here: no torch import.
"""

from __future__ import annotations

import argparse
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
# run(command, quiet=False) -> (exit status, output): quiet holds the output (pip's plans), else it is shown and "".
Run = Callable[..., "tuple[int, str]"]


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


def _run(command: list[str], quiet: bool = False) -> tuple[int, str]:
    if not quiet:
        return subprocess.run(command).returncode, ""
    proc = subprocess.run(command, capture_output=True, text=True)
    return proc.returncode, proc.stdout + proc.stderr


def build_of(version: str) -> str:
    """What build a torch version is, by its local label (``+cpu``, ``+cu126``; none: PyPI's)."""
    label = version.partition("+")[2]
    cuda = re.fullmatch(r"cu(\d+)(\d)", label)
    if label == "cpu":
        return "CPU only"
    if cuda:
        return f"CUDA {cuda.group(1)}.{cuda.group(2)}"
    if label.startswith("rocm"):
        return f"ROCm {label[4:]}"
    if label:
        return label
    return "PyPI's build, with CUDA on Linux x86_64: several GB of CUDA libraries"


def build_change(found: str | None, planned: str | None, cpu: bool = False) -> str | None:
    """The line to say before a step that changes torch's build (``found`` and ``planned``:
    torch's versions); None where it keeps the build, or where no torch was installed."""
    if found is None or planned is None or found.partition("+")[2] == planned.partition("+")[2]:
        return None
    keep = (
        "" if cpu or not found.endswith("+cpu") else "; to stay on the CPU build: python scripts/install_cpu_torch.py"
    )
    return (
        f"this changes torch's build: torch {found} ({build_of(found)}) -> torch {planned} ({build_of(planned)}){keep}"
    )


def repair(cpu: bool = False, run: Run = _run) -> int:
    """Leave a working torch/torchvision pair, or none changed (see the module's docstring);
    returns the exit status. ``run`` runs a command (a test gives its own)."""
    found: Pair = (installed("torch"), installed("torchvision"))
    if run([sys.executable, "-c", CHECK])[0] == 0:
        print("nothing changed")
        return 0
    pip = installed("pip") or "0"
    if tuple(int(n) for n in re.findall(r"\d+", pip)[:2]) < (22, 2):
        print(
            f"error: pip {pip} cannot plan an install (--dry-run --report); first: python -m pip install -U pip",
            file=sys.stderr,
        )
        return 1
    held: list[str] = []  # what pip said while planning: shown only if no pair could be made
    for why, args, wanted in _steps(cpu, found):
        planned, said = _plan(args, run)
        held += [line for line in said.splitlines() if line.strip()]
        if planned is None or not wanted(planned):
            print(
                f"- {why}: not to be had here"
                + (f" (pip would take torch {planned[0]}, torchvision {planned[1]})" if planned else "")
            )
            continue
        change = build_change(found[0], planned[0], cpu)
        if change:
            print(change, flush=True)
        print(f"+ pip {' '.join(args)}", flush=True)
        if run(_pip(args))[0] == 0 and run([sys.executable, "-c", CHECK])[0] == 0:
            return 0
        _put_back(found, run)
    for line in held:  # why the steps were not to be had, in pip's words
        print(f"  pip, planning: {line}")
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


def _plan(args: list[str], run: Run) -> tuple[Pair | None, str]:
    """The pair ``pip`` with ``args`` would leave (a dry run; None where pip cannot plan it),
    and what pip said (held, not shown)."""
    with tempfile.TemporaryDirectory() as folder:
        report = Path(folder) / "report.json"
        code, said = run(_pip([args[0], "--dry-run", "-qq", "--report", str(report), *args[1:]]), quiet=True)
        if code != 0 or not report.exists():
            return None, said
        chosen = {
            item["metadata"]["name"].lower(): item["metadata"]["version"]
            for item in json.loads(report.read_text())["install"]
        }
    return (chosen.get("torch", installed("torch")), chosen.get("torchvision", installed("torchvision"))), said


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


class _OneLine(argparse.ArgumentParser):
    """argparse's error as one line with the usage in it, exit status 2."""

    def error(self, message: str):  # type: ignore[override]
        print(f"error: {message}; usage: {self.format_usage().strip().removeprefix('usage: ')}", file=sys.stderr)
        sys.exit(2)


def parse(argv: list[str] | None, prog: str = REPAIR, cpu_flag: bool = True) -> argparse.Namespace:
    """The command's arguments: ``--cpu`` (the CPU wheels first) where ``cpu_flag``; anything
    else is one line and exit status 2."""
    p = _OneLine(
        prog=prog,
        description="Leave a working torch/torchvision pair, or the one found unchanged; each step is planned "
        "with pip's dry run first and checked after (docs/guide/usage.md#torch-without-a-gpu)",
    )
    if cpu_flag:
        p.add_argument("--cpu", action="store_true", help="try the CPU wheels first (download.pytorch.org/whl/cpu)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """``python -m gradmod.install [--cpu]``."""
    return repair(cpu=parse(argv).cpu)


if __name__ == "__main__":
    sys.exit(main())
