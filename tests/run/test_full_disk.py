"""A disk that fills up during a run: the error names the file it could not write, and the
run's summary.json says how it ended (the run's reserve gives it room), never ``running``.
The disk is a 2 MiB tmpfs mounted in a user namespace of the test's own (``unshare``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from helpers import ROOT, TINY_FAKE


def _can_mount() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", "mount -t tmpfs tmpfs /mnt"]
    return subprocess.run(probe, capture_output=True).returncode == 0


@pytest.mark.slow  # a run in a process of its own
@pytest.mark.skipif(not _can_mount(), reason="needs unshare and user namespaces to mount a small tmpfs")
def test_a_full_disk_names_the_file_and_leaves_a_failed_summary(tmp_path):
    disk, copy = tmp_path / "disk", tmp_path / "copy"
    disk.mkdir()
    tiny = [o for o in TINY_FAKE if not o.startswith("trainer.epochs")]
    train = [
        sys.executable,
        str(ROOT / "train.py"),
        f"hydra.run.dir={disk}/run",
        *tiny,
        "trainer.epochs=30",
        "+hooks=[clip,log]",
    ]
    train += ["trainer.checkpoint_keep=100", f"data_dir={tmp_path / 'data'}"]
    script = 'mount -t tmpfs -o size=2m tmpfs "$1" && shift 2 && "$@"; code=$?; cp -r "$D/run" "$C"; exit $code'
    env = {**os.environ, "PYTHONPATH": str(ROOT), "D": str(disk), "C": str(copy)}
    proc = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script, "sh", str(disk), "--", *train],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    errors = [ln for ln in proc.stderr.splitlines() if not ln.startswith("[")]  # log lines start with a time
    assert proc.returncode == 1 and len(errors) == 1, proc.stderr
    assert errors[0].startswith(f"error: cannot write {disk}/run/") and "No space left on device" in errors[0]
    assert not errors[0].rstrip(":").endswith(f"{disk}/run: No space left on device")  # a file, not the folder
    summary = json.loads((copy / "summary.json").read_text())
    assert summary["status"] == "failed" and "No space left on device" in summary["error"]
