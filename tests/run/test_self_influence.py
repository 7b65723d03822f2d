"""``gradmod scores RUN``: TracIn self-influence over a run's checkpoints, against Captum's
``TracInCP.self_influence`` on the same checkpoints; its files; bad input in one line."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys

import pytest
import torch
from helpers import ROOT, TINY_FAKE, checkpoint_folder, compose_config

from gradmod.hooks.score_columns import COLUMNS, SELF_INFLUENCE_FILE
from gradmod.run.folder import checkpoint_file as ckpt

# 2 epochs of 6 steps, a checkpoint every 4 steps and at each epoch's end (steps 4, 6, 8, 12),
# a cosine learning rate: each checkpoint has a learning rate of its own.
RUN = [*TINY_FAKE, "trainer.checkpoint_every_steps=4", "trainer.checkpoint_keep=10", "scheduler=cosine", "+hooks=clip"]


@pytest.fixture(scope="module")
def scored(tmp_path_factory):
    from gradmod.analysis.score_report import score_run
    from gradmod.app.cli import run

    out = tmp_path_factory.mktemp("run")
    run(compose_config(*RUN), out)
    return out, score_run(out, batch_size=16, top=8, device="cpu")


def _scores(out) -> dict[int, tuple[int, float]]:
    with open(out / "self_influence.csv") as f:
        rows = list(csv.DictReader(f))
    assert tuple(rows[0]) == COLUMNS[SELF_INFLUENCE_FILE]
    scores = [float(r["score"]) for r in rows]
    assert scores == sorted(scores, reverse=True)  # highest first
    return {int(r["index"]): (int(r["label"]), float(r["score"])) for r in rows}


@pytest.mark.slow
def test_a_runs_self_influence_equals_captums_tracincp(scored):
    captum = pytest.importorskip("captum.influence", reason="captum is the reference: pip install -e '.[dev]'")
    from torch.utils.data import TensorDataset

    from gradmod.analysis.self_influence import read_checkpoint, run_data, run_model
    from gradmod.data import as_float

    out, _ = scored
    paths = ckpt.checkpoints(out / "checkpoints")
    assert [ckpt.step_of(p) for p in paths] == [4, 6, 8, 12]
    config = read_checkpoint(paths[-1])[1]
    data = run_data(config, out)
    model = run_model(config, data)()

    def load(m, path):
        checkpoint, _ = read_checkpoint(path)
        m.load_state_dict(checkpoint.model)
        m.eval()
        return checkpoint.lr

    rates = [load(model, p) for p in paths]
    assert len(set(rates)) == 4  # the cosine schedule: the weighting is tested
    tracin = captum.TracInCP(
        model,
        TensorDataset(as_float(data.train_x), data.train_y),
        checkpoints=[str(p) for p in paths],
        checkpoints_load_func=load,
        loss_fn=torch.nn.CrossEntropyLoss(reduction="none"),
        batch_size=16,
    )
    expected = tracin.self_influence(show_progress=False).double()
    ours = _scores(out)
    assert sorted(ours) == list(range(60))
    got = torch.tensor([ours[i][1] for i in range(60)], dtype=torch.float64)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * float(expected.abs().max()))
    assert [ours[i][0] for i in range(60)] == data.train_y.tolist()


@pytest.mark.slow
def test_the_command_writes_its_files_and_says_what_tops_the_list(scored):
    out, result = scored
    for name in ("self_influence.csv", "hardest.png", "self_influence_hist.png", "self_influence_by_class.png"):
        assert (out / name).stat().st_size > 0, name
    top = sorted(_scores(out).items(), key=lambda kv: -kv[1][1])[:8]
    assert [t["index"] for t in result["top"]] == [i for i, _ in top]
    assert result["checkpoints"] == [p.name for p in ckpt.checkpoints(out / "checkpoints")]
    assert set(result["mean_by_class"]) <= set(range(10))


def _scores_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run(
        [sys.executable, "-m", "gradmod", "scores", *args], capture_output=True, text=True, env=env, timeout=300
    )


@pytest.mark.slow
def test_the_console_script_runs_the_command(scored):
    out, _ = scored
    proc = _scores_cli(str(out), "--top", "4", "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("highest self-influence (index (label/prediction)): ")
    proc = _scores_cli(str(out / "nowhere"))
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"error: gradmod scores: {out / 'nowhere'} is not a folder; give the run folder a gradmod run wrote"
    ]


# -- fast: checkpoints made here ---------------------------------------------------------------

FAKE = {"name": "fake", "batch_size": 8, "train_size": 16, "test_size": 8, "image_size": 28, "channels": 1}
CONFIG = {"data": FAKE, "data_dir": "data", "seed": 3, "model": {"name": "mnist_cnn", "norm": "batch"}}


def _checkpoints(folder, rates=(0.3, 0.02)) -> list:
    return checkpoint_folder(folder, CONFIG, rates)


def test_self_influence_equals_captums_tracincp(tmp_path):
    captum = pytest.importorskip("captum.influence", reason="captum is the reference: pip install -e '.[dev]'")
    from torch.utils.data import TensorDataset

    from gradmod.analysis.self_influence import read_checkpoint, run_data, run_model, self_influence
    from gradmod.data import as_float

    paths = _checkpoints(tmp_path)
    data = run_data(CONFIG, tmp_path)
    build = run_model(CONFIG, data)
    model = build()

    def load(m, path):
        checkpoint, _ = read_checkpoint(path)
        m.load_state_dict(checkpoint.model)
        m.eval()
        return checkpoint.lr

    dataset = TensorDataset(as_float(data.train_x), data.train_y)
    loss = torch.nn.CrossEntropyLoss(reduction="none")
    tracin = captum.TracInCP(model, dataset, [str(p) for p in paths], load, loss_fn=loss, batch_size=8)
    expected = tracin.self_influence(show_progress=False).double()
    checkpoints = [read_checkpoint(p)[0] for p in paths]
    got = self_influence(build, checkpoints, data.train_x, data.train_y, batch_size=7)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * float(expected.abs().max()))


def _bad_folders(tmp_path) -> dict:
    good = tmp_path / "good"
    paths = _checkpoints(good)
    made = {"missing": tmp_path / "missing", "plain": tmp_path / "plain", "bare": tmp_path / "bare"}
    made["plain"].mkdir()
    (made["bare"] / ".gradmod").mkdir(parents=True)
    (made["bare"] / ".gradmod" / "run.json").write_text(json.dumps({"run_id": "r1"}))
    for name in ("other", "broken"):
        (tmp_path / name / ".gradmod").mkdir(parents=True)
        (tmp_path / name / ".gradmod" / "run.json").write_text(json.dumps({"run_id": "r1"}))
        (tmp_path / name / "checkpoints").mkdir()
        made[name] = tmp_path / name
    (made["other"] / "checkpoints" / paths[0].name).write_bytes(paths[0].read_bytes())
    (made["other"] / "summary.json").write_text(json.dumps({"dataset": "mnist", "train_size": 60000}))
    (made["broken"] / "checkpoints" / paths[0].name).write_bytes(paths[0].read_bytes()[:-10])
    made["good"] = good
    return made


def test_bad_input_is_one_line_each(tmp_path, capsys):
    from gradmod.app.scores_command import main

    folders = _bad_folders(tmp_path)
    cases = [
        (["missing"], "is not a folder; give the run folder a gradmod run wrote"),
        (["plain"], r"is not a gradmod run folder \(no .gradmod/run.json\)"),
        (["bare"], r"has no checkpoints \(checkpoints/step-\*.pt\).*trainer.checkpoint_keep=EPOCHS"),
        (["other"], r"trained on mnist \(60000 examples\) but data_dir='data' gives fake \(16\); give --data-dir"),
        (["broken"], "truncated or corrupt"),
        (["good", "--top", "0"], "--top 0: both must be >= 1"),
        (["good", "--batch-size", "-1"], "--batch-size -1 and --top 24: both must be >= 1"),
        (["good", "--top", "many"], r"argument --top: invalid int value: 'many'; usage: gradmod scores RUN"),
    ]
    for (name, *rest), message in cases:
        try:
            assert main([str(folders[name]), *rest]) == 2, name
        except SystemExit as e:  # argparse's own refusals
            assert e.code == 2, name
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: gradmod scores: "), (name, lines)
        assert re.search(message, lines[0]), (name, lines[0])
        assert not (folders[name] / "self_influence.csv").exists()


# -- runs whose examples are not images, checkpoints of another model, runs still training ------

OBJ = "tests.support.user_objects"
VECTORS = {  # 40 examples of 64 float features each, a linear model: no image anywhere
    "data": {"name": f"{OBJ}.data", "_target_": f"{OBJ}.data", "args": {"shape": [64], "dtype": "float32"}},
    "data_dir": "data",
    "seed": 3,
    "model": {"name": f"{OBJ}.Tiny", "_target_": f"{OBJ}.Tiny"},
}


def _vector_checkpoints(folder) -> list:
    """A finished run of the linear model on vectors: two checkpoints and an ending."""
    from tests.support.user_objects import Tiny

    (folder / ".gradmod").mkdir(parents=True)
    (folder / ".gradmod" / "run.json").write_text(json.dumps({"run_id": "r2"}) + "\n")
    (folder / "summary.json").write_text(json.dumps({"status": "ok"}))
    torch.manual_seed(0)
    model, paths = Tiny(), []
    for step in (1, 2):
        state = {
            "step": step,
            "model": {k: v.clone() for k, v in model.state_dict().items()},
            "trainer": {"optimizer": {"param_groups": [{"lr": 0.1}]}},
            "config": VECTORS,
        }
        paths.append(ckpt.save(folder / "checkpoints", state, keep=10, run="r2"))
    return paths


def test_examples_that_are_not_images_get_every_file_but_hardest_png_and_a_line_saying_why(tmp_path, capsys, caplog):
    from gradmod.app.scores_command import main

    _vector_checkpoints(tmp_path)
    with caplog.at_level("INFO", logger="gradmod.scores"):
        assert main([str(tmp_path), "--device", "cpu", "--top", "4"]) == 0
    rows = _scores(tmp_path)
    assert sorted(rows) == list(range(40))
    for name in ("self_influence_hist.png", "self_influence_by_class.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    assert not (tmp_path / "hardest.png").exists()
    said = [r.getMessage() for r in caplog.records if "hardest.png" in r.getMessage()]
    assert said == [
        "hardest.png not drawn: the examples are not images (each is 64 float32; images are C x H x W "
        "with 1 or 3 channels, or H x W pixels)"
    ]
    out = capsys.readouterr().out
    assert out.startswith("highest self-influence") and "hardest.png" not in out


def test_colour_images_are_drawn_in_colour(tmp_path):
    from gradmod.reporting.score_plots import image_shaped, plot_hardest

    images = torch.zeros(3, 3, 8, 8, dtype=torch.uint8)
    images[:, 0] = 255  # red
    assert image_shaped(images) and image_shaped(images[:, :1]) and image_shaped(images[:, 0])
    assert not image_shaped(images.float()[:, 0]) and not image_shaped(torch.zeros(3, 64))
    path = plot_hardest(images, [0, 1, 2], [0, 1, 1], [3.0, 2.0, 1.0], tmp_path / "hardest.png")
    import matplotlib.image

    pixels = matplotlib.image.imread(path)[..., :3]
    reddish = (pixels[..., 0] > 0.8) & (pixels[..., 1] < 0.2) & (pixels[..., 2] < 0.2)
    assert reddish.sum() > 50  # the tiles are red, not grey


def test_a_checkpoint_of_another_model_is_one_line_naming_it(tmp_path, capsys):
    from gradmod.app.scores_command import main

    _vector_checkpoints(tmp_path / "run")
    other = _checkpoints(tmp_path / "cnn")[0]  # the MNIST CNN's, of another run
    stray = tmp_path / "run" / "checkpoints" / "step-000000003.pt"
    stray.write_bytes(other.read_bytes())
    assert main([str(tmp_path / "run"), "--device", "cpu"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"error: gradmod scores: checkpoint {stray} is not of this run's model ({OBJ}.Tiny): ")
    assert "it lacks fc.weight, fc.bias" in lines[0]
    assert not (tmp_path / "run" / "self_influence.csv").exists()


def test_a_run_still_training_is_refused_and_one_without_an_ending_warned(tmp_path, capsys, caplog):
    import fcntl

    from gradmod.app.scores_command import main

    _vector_checkpoints(tmp_path)
    (tmp_path / "summary.json").write_text(json.dumps({"status": "running"}))
    (tmp_path / ".gradmod" / "lock.pid").write_text("4242\n")
    with open(tmp_path / ".gradmod" / "lock", "a") as held:  # as the training process holds it
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert main([str(tmp_path), "--device", "cpu"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [
        f"error: gradmod scores: {tmp_path} is still training (pid 4242 holds its lock): its checkpoints are "
        "not all there yet and the oldest may still be pruned; score it once the run has ended"
    ]
    assert not (tmp_path / "self_influence.csv").exists()
    with caplog.at_level("INFO", logger="gradmod.scores"):  # the lock released: a run that was killed
        assert main([str(tmp_path), "--device", "cpu"]) == 0
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warned == [
        f"warning: {tmp_path} has no ending (the run was killed while training): scoring the 2 checkpoints it left"
    ]
    assert (tmp_path / "self_influence.csv").is_file()


def test_scoring_logs_progress_with_what_is_left(tmp_path, caplog, monkeypatch):
    from gradmod.analysis import score_report
    from gradmod.reporting import progress

    _vector_checkpoints(tmp_path)
    monkeypatch.setattr(progress, "EVERY", 0.0)  # a line at every batch
    with caplog.at_level("INFO", logger="gradmod.scores"):
        score_report.score_run(tmp_path, batch_size=10, device="cpu")
    said = [r.getMessage() for r in caplog.records]
    assert said[1].startswith("checkpoint 1/2: step-000000001.pt (step 1, lr 0.1)")
    assert any(
        re.fullmatch(r"checkpoint 2/2: step-000000002\.pt \(step 2, lr 0\.1\); about \d+ s left", s) for s in said
    )
    lines = [s for s in said if s.startswith("self-influence: ")]
    assert re.fullmatch(
        r"self-influence: 20/80 examples \(25%\), \d+ s so far, about \d+ s left \(checkpoint 1/2\)", lines[1]
    )
    assert lines[-1].startswith("self-influence: 70/80 examples (88%)") and lines[-1].endswith("(checkpoint 2/2)")
