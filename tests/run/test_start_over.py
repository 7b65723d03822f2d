"""``trainer.start_over=true`` removes what gradmod wrote in the folder, and nothing else."""

from __future__ import annotations

from helpers import RESUMABLE, compose_config

from gradmod.app.cli import run
from gradmod.run.folder import checkpoint_file as ckpt


def test_start_over_keeps_files_gradmod_did_not_write(tmp_path):
    tiny = [*RESUMABLE, "trainer.epochs=1"]
    run(compose_config(*tiny), tmp_path)
    ours = ckpt.checkpoints(tmp_path / "checkpoints")
    assert ours and all(ckpt.written_by_gradmod(p) for p in ours)
    aside = tmp_path / "checkpoints" / "abandoned-1"
    aside.mkdir()
    (aside / "README").write_text("my notes\n")
    ours[0].replace(aside / ours[0].name)  # a set-aside checkpoint of gradmod's, beside the user's file
    foreign = tmp_path / "checkpoints" / "step-000000999.pt"
    foreign.write_bytes(b"my own weights, no header\n")

    summary = run(compose_config(*tiny, "trainer.start_over=true"), tmp_path)

    assert summary["status"] == "ok" and summary["resumed_from"] is None
    assert foreign.read_bytes() == b"my own weights, no header\n"
    assert (aside / "README").read_text() == "my notes\n"
    assert sorted(p.name for p in aside.iterdir()) == ["README"]  # gradmod's own file there is gone
    new = [p for p in ckpt.checkpoints(tmp_path / "checkpoints") if p != foreign]
    assert new and all(ckpt.run_of(p) == summary["run"] for p in new)
