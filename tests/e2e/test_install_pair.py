"""torch and torchvision that do not work together are one line with the command that repairs
them; the repair (and the CPU install script) changes nothing where the pair works, takes a
step only where pip's plan is one release and one build, and undoes a step whose pair fails."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT, TINY_FAKE

import gradmod.install as pair_install
from gradmod.install import REPAIR, build_change, installed, matching_torchvision, one_build, parse


def test_the_torchvision_of_a_torch_release():
    assert matching_torchvision("2.6.0") == "0.21.0"  # torch 2.6's release (torchvision's notes)
    assert matching_torchvision("2.13.0+cpu") == "0.28.0+cpu"
    assert matching_torchvision("1.13.1") is None
    here = matching_torchvision(installed("torch"))  # this environment's pair works (the suite runs)
    assert here.partition("+")[0] == installed("torchvision").partition("+")[0]
    assert one_build(("2.13.0+cpu", "0.28.0+cpu")) and one_build(("2.14.1", "0.29.1"))
    assert not one_build(("2.13.0+cpu", "0.28.0"))  # the pair a CPU torch and PyPI's torchvision make
    assert not one_build(("2.14.1", "0.28.0")) and not one_build((None, "0.29.1"))


@pytest.mark.slow  # a process of its own that imports torch
def test_a_torchvision_built_for_another_torch_is_one_line(tmp_path):
    fake = tmp_path / "torchvision"
    fake.mkdir()
    (fake / "__init__.py").write_text('raise RuntimeError("operator torchvision::nms does not exist")\n')
    proc = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), f"hydra.run.dir={tmp_path / 'run'}", *TINY_FAKE],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": f"{tmp_path}:{ROOT}"},
        timeout=120,
    )
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
    line = proc.stderr.strip()
    assert line.startswith(f"error: torch {installed('torch')} and torchvision {installed('torchvision')} do not")
    assert "torchvision::nms does not exist" in line and line.endswith(REPAIR)


# What pip prints where it cannot plan a step (a torchvision whose torch is not to be had).
UNPLANNED = (
    "ERROR: Cannot install torchvision==0.28.0+cpu because these package versions have conflicting dependencies.\n"
    "ERROR: ResolutionImpossible: for help visit https://pip.pypa.io/en/latest/topics/dependency-resolution/\n"
)


class FakePip:
    """An environment of one torch and one torchvision, and a pip over it: ``plans`` maps a
    step's package arguments to the pair pip would install; a pair works when ``works`` says.
    Called as ``gradmod.install`` runs a command: ``(exit status, output held where quiet)``."""

    def __init__(self, found, plans, works):
        self.state = dict(zip(("torch", "torchvision"), found))
        self.plans, self.works, self.installs = plans, works, []

    def installed(self, name):
        return "23.2.1" if name == "pip" else self.state.get(name)

    def __call__(self, cmd, quiet=False):
        if cmd[1] == "-c":  # the check
            return (0 if (self.state["torch"], self.state["torchvision"]) in self.works else 1), ""
        args = cmd[3:]
        if "--dry-run" in args:
            assert quiet  # a plan's words are held
            planned = self.plans.get(self._key(args))
            if planned is None:
                return 1, UNPLANNED  # an index that cannot be reached, a pair that cannot be: pip finds nothing
            items = [{"metadata": {"name": n, "version": v}} for n, v in zip(("torch", "torchvision"), planned)]
            Path(args[args.index("--report") + 1]).write_text(json.dumps({"install": items}))
            return 0, ""
        self.installs.append(" ".join(args))
        if args[0] == "uninstall":
            self.state[args[-1]] = None
        elif "--force-reinstall" in args:  # putting back: name==version
            name, version = args[-1].split("==")
            self.state[name] = version
        else:
            self.state.update(zip(("torch", "torchvision"), self.plans[self._key(args)]))
        return 0, ""

    @staticmethod
    def _key(args):
        return " ".join(a for a in args if a in ("torch", "torchvision") or a.startswith("torchvision=="))


def _repair(monkeypatch, pip, cpu=True):
    monkeypatch.setattr(pair_install, "installed", pip.installed)
    return pair_install.repair(cpu=cpu, run=pip)


def test_a_working_pair_is_left_as_it_is(monkeypatch, capsys):
    pip = FakePip(("2.14.1", "0.29.1"), {"torch torchvision": ("2.14.1+cpu", "0.29.1+cpu")}, {("2.14.1", "0.29.1")})
    assert _repair(monkeypatch, pip) == 0
    assert pip.installs == [] and "nothing changed" in capsys.readouterr().out


def test_a_step_that_would_mix_builds_is_not_taken(monkeypatch, capsys):
    """The machine this was seen on: its CPU index out of reach, a CPU torch in pip's
    find-links and PyPI's (CUDA) torchvision; the broken pair is repaired by a release pair
    of one build from pip's own indexes, and no mixed pair is ever installed."""
    plans = {"torch torchvision": ("2.13.0+cpu", "0.28.0")}  # the CPU step: the CPU torch, PyPI's torchvision
    pip = FakePip(("2.13.0+cpu", "0.28.0"), plans, {("2.14.1", "0.29.1")})
    assert _repair(monkeypatch, pip) == 1  # the CPU step mixes; the own torchvision is not to be had
    assert pip.installs == [] and pip.state == {"torch": "2.13.0+cpu", "torchvision": "0.28.0"}
    err = capsys.readouterr()
    assert "- the CPU wheels: not to be had here (pip would take torch 2.13.0+cpu, torchvision 0.28.0)" in err.out
    assert err.err.startswith("error: no working torch/torchvision pair could be made here; nothing changed")

    assert "\n  pip, planning: ERROR: ResolutionImpossible" in err.out  # pip's reasons, where nothing worked
    assert err.err.count("\n") == 1

    pip = FakePip(("2.13.0+cpu", "0.28.0"), {"torch torchvision": ("2.14.1", "0.29.1")}, {("2.14.1", "0.29.1")})
    assert _repair(monkeypatch, pip, cpu=False) == 0  # pip's own indexes hold a release pair of one build
    assert pip.installs == ["install --upgrade torch torchvision"]
    assert pip.state == {"torch": "2.14.1", "torchvision": "0.29.1"}
    out = capsys.readouterr()
    assert "ResolutionImpossible" not in out.out + out.err  # the planning's words stay out of a repair that worked
    said = out.out.splitlines()
    change = said.index(f"{build_change('2.13.0+cpu', '2.14.1')}")  # said before it installs
    assert said[change + 1] == "+ pip install --upgrade torch torchvision"


def test_a_change_of_torchs_build_is_one_line_naming_both():
    assert build_change("2.13.0+cpu", "2.14.1") == (
        "this changes torch's build: torch 2.13.0+cpu (CPU only) -> torch 2.14.1 (PyPI's build, with CUDA on Linux "
        "x86_64: several GB of CUDA libraries); to stay on the CPU build: python scripts/install_cpu_torch.py"
    )
    assert build_change("2.14.1+cu126", "2.14.1+cpu", cpu=True) == (
        "this changes torch's build: torch 2.14.1+cu126 (CUDA 12.6) -> torch 2.14.1+cpu (CPU only)"
    )
    assert build_change("2.13.0+cpu", "2.13.0+cpu") is None and build_change("2.14.1", "2.14.1") is None
    assert build_change(None, "2.14.1") is None  # nothing installed: no build changes


def test_the_commands_take_cpu_and_refuse_anything_else_in_one_line(capsys):
    assert parse([]).cpu is False and parse(["--cpu"]).cpu is True
    for argv, prog, cpu_flag in [
        (["--bogus"], REPAIR, True),
        (["--cpu"], "python scripts/install_cpu_torch.py", False),
    ]:
        with pytest.raises(SystemExit) as info:
            parse(argv, prog=prog, cpu_flag=cpu_flag)
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"error: unrecognized arguments: {argv[0]}; usage: {prog}")


def test_the_torchvision_built_for_the_torch_is_pinned_to_its_build(monkeypatch):
    want = f"install --no-deps torchvision==0.28.0+cpu --index-url {pair_install.WHEELS}/cpu --retries 1 --timeout 10"
    pip = FakePip(("2.13.0+cpu", "0.28.0"), {"torchvision==0.28.0+cpu": ("2.13.0+cpu", "0.28.0+cpu")}, set())
    pip.works = {("2.13.0+cpu", "0.28.0+cpu")}
    assert _repair(monkeypatch, pip, cpu=False) == 0
    assert pip.installs == [want]


def test_a_step_whose_pair_fails_the_check_is_undone(monkeypatch, capsys):
    pip = FakePip((None, None), {"torch torchvision": ("2.14.1+cpu", "0.29.1+cpu")}, set())  # nothing works here
    assert _repair(monkeypatch, pip) == 1
    assert pip.installs[0].startswith("install --upgrade torch torchvision --index-url")
    assert pip.installs[1:] == ["uninstall -y torch", "uninstall -y torchvision"]  # as found: none
    assert pip.state == {"torch": None, "torchvision": None}
    assert "pip install -e . installs PyPI's pair" in capsys.readouterr().err
