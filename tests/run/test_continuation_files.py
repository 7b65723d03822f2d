"""A continued run replaces every file it changes by rename: a hard-link backup of the
folder (``cp -al``) keeps the bytes it had when it was taken."""

from __future__ import annotations

import hashlib
import os
import subprocess

import pytest
from helpers import TINY_FAKE, run_train


def _digests(folder):
    return {
        p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.mark.slow  # two runs in processes of their own
def test_a_continuation_leaves_a_hard_link_backup_as_it_was(tmp_path):
    run, backup = tmp_path / "run", tmp_path / "backup"
    tiny = [o for o in TINY_FAKE if not o.startswith("trainer.epochs")]
    run_train(run, *tiny, "trainer.epochs=1", "+hooks=[clip,log]")
    subprocess.run(["cp", "-al", str(run), str(backup)], check=True)
    before = _digests(backup)
    assert {"metrics.jsonl", "grad_stats.jsonl", "metrics.csv", "train.log", ".hydra/config.yaml"} <= before.keys()
    assert any(name.endswith(".png") for name in before)
    shared = {p for p in before if os.path.samefile(run / p, backup / p)}
    assert "train.log" in shared and "metrics.jsonl" in shared  # cp -al linked them

    run_train(run, *tiny, "trainer.epochs=2", "+hooks=[clip,log]", "trainer.resume=auto")

    assert _digests(backup) == before
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 2
    assert (run / "train.log").read_text().startswith((backup / "train.log").read_text())
