"""Checkpoints: atomic files, the newest k kept, broken ones skipped, exact resume."""

from __future__ import annotations

import logging
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import RESUMABLE, run_train, same_params

from gradmod.app.cli import run
from gradmod.reporting import run_summary
from gradmod.run.folder import checkpoint_file as ckpt

# A tiny run: 60 fake 28x28 images in batches of 10 -> 6 steps per epoch.


def test_save_load_and_keep_last(tmp_path):
    for step in (1, 2, 3, 4):
        ckpt.save(tmp_path, {"step": step, "w": torch.full((3,), float(step))}, keep=2)
    files = ckpt.checkpoints(tmp_path)
    assert [f.name for f in files] == ["step-000000003.pt", "step-000000004.pt"]
    assert torch.equal(ckpt.load(files[-1])["w"], torch.full((3,), 4.0))
    assert not list(tmp_path.glob(".*.tmp"))


def test_torch_load_reads_a_checkpoint_as_it_is(tmp_path):
    """A checkpoint is torch.save's zip archive with its checksum and run in the archive's
    comment: torch.load (weights_only, its default) reads it, and zipfile sees the comment."""
    import hashlib
    import io
    import zipfile

    state = {"step": 7, "w": torch.arange(5.0), "config": "lr: 0.1"}
    path = ckpt.save(tmp_path, state, keep=1, run="r1")
    plain = torch.load(path, weights_only=True)
    assert plain.keys() == state.keys() and torch.equal(plain["w"], state["w"]) and plain["step"] == 7
    comment = zipfile.ZipFile(path).comment
    buf = io.BytesIO()
    torch.save(state, buf)  # the same archive, as torch.save writes it
    assert (
        comment == b"gradmod-checkpoint v2 sha256=" + hashlib.sha256(buf.getvalue()).hexdigest().encode() + b" run=r1"
    )
    assert ckpt.run_of(path) == "r1" and ckpt.written_by_gradmod(path) and ckpt.load(path)["step"] == 7


def test_a_checkpoint_of_the_first_format_is_still_read(tmp_path):
    """A header line with the checksum, then the archive: what earlier versions wrote."""
    import hashlib
    import io

    buf = io.BytesIO()
    torch.save({"step": 4, "w": torch.ones(2)}, buf)
    payload = buf.getvalue()
    path = tmp_path / "step-000000004.pt"
    path.write_bytes(
        b"gradmod-checkpoint v1 sha256=" + hashlib.sha256(payload).hexdigest().encode() + b" run=old\n" + payload
    )
    assert ckpt.run_of(path) == "old" and ckpt.written_by_gradmod(path)
    assert ckpt.load(path)["step"] == 4 and ckpt.latest(tmp_path, "old")[0] == path
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(ckpt.CheckpointError, match="checksum mismatch"):
        ckpt.load(path)


@pytest.mark.parametrize("damage", ["truncate", "flip", "empty", "not_a_checkpoint"])
def test_broken_newest_is_skipped_with_a_warning(tmp_path, caplog, damage):
    ckpt.save(tmp_path, {"step": 1, "w": torch.ones(100)}, keep=5)
    good = ckpt.save(tmp_path, {"step": 2, "w": torch.ones(100) * 2}, keep=5)
    bad = tmp_path / "step-000000003.pt"
    data = good.read_bytes()
    if damage == "truncate":
        bad.write_bytes(data[: len(data) // 2])
    elif damage == "flip":  # one byte inside the tensor data: only the checksum notices
        b = bytearray(data)
        b[data.find((torch.ones(100) * 2).numpy().tobytes()) + 8] ^= 0x01
        bad.write_bytes(bytes(b))
    elif damage == "empty":
        bad.write_bytes(b"")
    else:
        torch.save({"step": 3}, bad)
    with pytest.raises(ckpt.CheckpointError):
        ckpt.load(bad)
    with caplog.at_level(logging.WARNING, logger="gradmod.run.folder.checkpoint_file"):
        path, state = ckpt.latest(tmp_path)
    assert path == good and state["step"] == 2
    assert "skipping" in caplog.text and bad.name in caplog.text
    with pytest.raises(ValueError, match="trainer.resume"):  # a file named explicitly must verify
        ckpt.find(str(bad), tmp_path)


def test_auto_without_a_checkpoint_warns_where_it_looked(tmp_path, caplog):
    folder = tmp_path / "run" / "checkpoints"
    with caplog.at_level(logging.WARNING, logger="gradmod.run.folder.checkpoint_file"):
        assert ckpt.find("auto", folder) is None
    [record] = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert str(folder) in record.getMessage() and "hydra.run.dir=<the earlier run folder>" in record.getMessage()


def test_rng_state_round_trip():
    state = ckpt.rng_state()
    a = (random.random(), np.random.rand(), torch.rand(3))
    ckpt.set_rng_state(state)
    b = (random.random(), np.random.rand(), torch.rand(3))
    assert a[0] == b[0] and a[1] == b[1] and torch.equal(a[2], b[2])


def _resume(compose_cfg, out: Path):
    return run(compose_cfg(*RESUMABLE, "trainer.resume=auto"), out)


def test_sigkill_mid_epoch_then_resume_is_exact(tmp_path, compose_cfg, reference):
    # Killed (SIGKILL, no cleanup) after step 9 of 12: mid epoch 2; the newest checkpoint is step 8.
    proc = run_train(tmp_path, *RESUMABLE, check=False, env={"GRADMOD_KILL_AT": "step:9"})
    assert proc.returncode == -9, proc.stderr
    assert run_summary.read(tmp_path)["status"] == "killed"  # it said running; no process holds the folder
    assert ckpt.latest(tmp_path / "checkpoints")[1]["trainer"]["batch"] == 2  # mid-epoch position
    summary = _resume(compose_cfg, tmp_path)
    params, ref_summary, ref_metrics = reference
    same_params(torch.load(tmp_path / "model.pt"), params)
    assert summary["resumed_from"].endswith("step-000000008.pt")
    assert summary["train_loss"] == ref_summary["train_loss"] and summary["steps"] == 12

    def strip(text):
        return [
            {k: v for k, v in __import__("json").loads(ln).items() if "seconds" not in k} for ln in text.splitlines()
        ]

    assert strip((tmp_path / "metrics.jsonl").read_text()) == strip(ref_metrics)
    # the CSV logger's files start afresh on resume and are refilled from the checkpoint's history
    assert (tmp_path / "metrics.csv").read_text().count("\n") == 3  # header + 2 epochs


def test_kill_during_checkpoint_write_keeps_the_previous(tmp_path, compose_cfg, reference, caplog):
    # Writes: step 4, epoch 1 (step 6), step 8 <- killed between temp file and rename.
    proc = run_train(tmp_path, *RESUMABLE, check=False, env={"GRADMOD_KILL_AT": "write:3"})
    assert proc.returncode == -9, proc.stderr
    folder = tmp_path / "checkpoints"
    assert [p.name for p in ckpt.checkpoints(folder)] == ["step-000000004.pt", "step-000000006.pt"]
    assert len(list(folder.glob(".step-000000008.pt.*.tmp"))) == 1  # the unfinished write
    # and a truncated newer file, as a crash without the atomic rename would leave
    (folder / "step-000000010.pt").write_bytes((folder / "step-000000006.pt").read_bytes()[:5000])
    with caplog.at_level(logging.WARNING):
        summary = _resume(compose_cfg, tmp_path)
    assert "step-000000010.pt" in caplog.text and "truncated or corrupt" in caplog.text
    assert summary["resumed_from"].endswith("step-000000006.pt")
    same_params(torch.load(tmp_path / "model.pt"), reference[0])
    assert not list(folder.glob(".*.tmp"))  # the stale temp file was cleaned up


def test_resume_from_a_path_mid_epoch_with_accumulation(tmp_path, compose_cfg):
    # 6 batches per epoch, 2 per optimizer step: 3 steps per epoch; a checkpoint every 2 steps.
    over = [*RESUMABLE, "trainer.accumulate=2", "trainer.checkpoint_every_steps=2", "trainer.checkpoint_keep=10"]
    full = tmp_path / "full"
    run(compose_cfg(*over), full)
    first = full / "checkpoints" / "step-000000002.pt"
    assert ckpt.load(first)["trainer"]["batch"] == 4  # two optimizer steps = four micro-batches into epoch 1
    summary = run(compose_cfg(*over, f"trainer.resume={first}"), tmp_path / "resumed")
    assert summary["resumed_from"] == str(first) and summary["steps"] == 6
    same_params(torch.load(tmp_path / "resumed" / "model.pt"), torch.load(full / "model.pt"))


def test_resume_drops_a_truncated_last_line_of_grad_stats(tmp_path, compose_cfg):
    # A run killed while writing grad_stats.jsonl leaves a cut-short last line; resuming
    # keeps the whole lines up to the checkpoint and drops the broken one.
    run(compose_cfg(*RESUMABLE), tmp_path)
    path = tmp_path / "grad_stats.jsonl"
    lines = path.read_text().splitlines()
    assert len(lines) == 2  # one read at the end of each epoch (steps 6 and 12)
    path.write_text(lines[0] + "\n" + lines[1][: len(lines[1]) // 2])
    summary = _resume(compose_cfg, tmp_path)
    assert summary["resumed_from"].endswith("step-000000012.pt")
    assert path.read_text().splitlines() == [lines[0]]
