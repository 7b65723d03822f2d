"""``gradmod influence RUN``: TracIn proponents and opponents of test examples over a run's
checkpoints, against Captum's ``TracInCP.influence`` and ``k_most_influential``; the projected
mode against exact by rank; its files; bad input in one line."""

from __future__ import annotations

import csv
import json
import re

import pytest
import torch
from helpers import checkpoint_folder

from gradmod.run.folder import checkpoint_file as ckpt

FAKE = {"name": "fake", "batch_size": 8, "train_size": 24, "test_size": 8, "image_size": 28, "channels": 1}
CONFIG = {"data": FAKE, "data_dir": "data", "seed": 3, "model": {"name": "mnist_cnn", "norm": "batch"}}


def _checkpoints(folder, rates=(0.3, 0.02, 0.1)) -> list:
    return checkpoint_folder(folder, CONFIG, rates)


def _captum(folder, paths, layers=None):
    captum = pytest.importorskip("captum.influence", reason="captum is the reference: pip install -e '.[dev]'")
    from torch.utils.data import TensorDataset

    from gradmod.analysis.self_influence import read_checkpoint, run_data, run_model
    from gradmod.data import as_float

    data = run_data(CONFIG, folder)

    def load(m, path):
        checkpoint, _ = read_checkpoint(path)
        m.load_state_dict(checkpoint.model)
        m.eval()
        return checkpoint.lr

    tracin = captum.TracInCP(
        run_model(CONFIG, data)(),
        TensorDataset(as_float(data.train_x), data.train_y),
        [str(p) for p in paths],
        load,
        layers=layers,
        loss_fn=torch.nn.CrossEntropyLoss(reduction="sum"),  # each example's own gradient, by Captum's hooks
        batch_size=8,
        sample_wise_grads_per_batch=True,
    )
    return tracin, data


def _csv(folder) -> list[dict]:
    with open(folder / "influence.csv") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["test_index", "train_index", "label", "score"]
    return rows


@pytest.mark.parametrize("params,layers", [pytest.param("*", None, marks=pytest.mark.slow), ("l1.*", ["l1"])])
def test_the_scores_equal_captums_tracincp_influence(tmp_path, params, layers):
    from gradmod.analysis.influence_report import influence_run
    from gradmod.data import as_float

    paths = _checkpoints(tmp_path)
    tracin, data = _captum(tmp_path, paths, layers)
    tests = [5, 0, 7]
    inputs = (as_float(data.test_x[tests]), data.test_y[tests])
    expected = tracin.influence(inputs, show_progress=False).double()  # [3, 24]
    result = influence_run(tmp_path, test=tests, k=4, params=[params], batch_size=5, device="cpu")
    rows = _csv(tmp_path)
    tol = 1e-4 * float(expected.abs().max())
    for row, t in enumerate(tests):
        mine = [r for r in rows if int(r["test_index"]) == t]
        assert len(mine) == 8
        for r in mine:
            i = int(r["train_index"])
            assert abs(float(r["score"]) - float(expected[row, i])) <= tol
            assert int(r["label"]) == int(data.train_y[i])
        assert [float(r["score"]) for r in mine] == sorted((float(r["score"]) for r in mine), reverse=True)
    proponents, scores = tracin.influence(inputs, k=4, proponents=True, show_progress=False)
    opponents, _ = tracin.influence(inputs, k=4, proponents=False, show_progress=False)
    for row, t in enumerate(result["tests"]):
        assert t["proponents"] == proponents[row].tolist()
        assert t["opponents"] == opponents[row].tolist()
    assert (tmp_path / "influence.png").stat().st_size > 0


def test_the_hardest_are_the_test_examples_of_highest_loss(tmp_path):
    import torch.nn.functional as F

    from gradmod.analysis.influence_report import influence_run
    from gradmod.analysis.self_influence import read_checkpoint, run_data, run_model
    from gradmod.data import as_float

    paths = _checkpoints(tmp_path)
    data = run_data(CONFIG, tmp_path)
    model = run_model(CONFIG, data)()
    model.load_state_dict(read_checkpoint(paths[-1])[0].model)
    model.eval()
    with torch.no_grad():
        losses = F.cross_entropy(model(as_float(data.test_x)), data.test_y, reduction="none")
    result = influence_run(tmp_path, hardest=3, k=2, device="cpu")
    assert [t["index"] for t in result["tests"]] == torch.argsort(losses, descending=True)[:3].tolist()


def test_projected_scores_rank_as_exact_ones(tmp_path):
    """A projection to 1024 dimensions against Captum's exact scores: the relative error about
    sqrt(2/d) (0.044), the ranks of the 12 largest kept (the MNIST CNN's top 100: the slow test)."""
    from gradmod.analysis.influence import influence, projection_error
    from gradmod.analysis.self_influence import read_checkpoint, run_model
    from gradmod.data import as_float

    paths = _checkpoints(tmp_path)
    tracin, data = _captum(tmp_path, paths)
    inputs = (as_float(data.test_x), data.test_y)
    exact = tracin.influence(inputs, show_progress=False).double()
    build, checkpoints = run_model(CONFIG, data), [read_checkpoint(p)[0] for p in paths]
    projected = influence(build, checkpoints, (data.train_x, data.train_y), (data.test_x, data.test_y), projection=1024)
    error = projection_error(exact, projected, top=12)
    assert error["spearman_mean"] >= 0.9 and error["relative_error"] < 0.15, error


def test_bad_input_is_one_line_each(tmp_path, capsys):
    from gradmod.app.influence_command import main

    good = tmp_path / "good"
    _checkpoints(good)
    bare = tmp_path / "bare"
    (bare / ".gradmod").mkdir(parents=True)
    (bare / ".gradmod" / "run.json").write_text(json.dumps({"run_id": "r1"}))
    cases = [
        ([bare], r"has no checkpoints \(checkpoints/step-\*.pt\); influence needs the run's checkpoints"),
        ([good, "--test", "3,8"], r"--test 8: out of range; the test set has 8 examples \(indices 0 to 7\)"),
        ([good, "--test", "-1"], r"--test -1: out of range"),
        ([good, "--params", "fc*"], r"--params: 'fc\*' matches no parameter; names look like: conv1.weight"),
        ([good, "--k", "0"], r"--k 0: must be >= 1"),
        ([good, "--k", "13"], r"--k 13: the training set has 24 examples; .* k <= 12"),
        ([good, "--projection", "0"], r"--projection 0: the projected dimension must be >= 1"),
        ([good, "--test", "a,b"], r"argument --test: 'a,b' is not a comma-separated list of test indices; usage"),
    ]
    for (folder, *rest), message in cases:
        try:
            assert main([str(folder), *rest]) == 2, rest
        except SystemExit as e:  # argparse's own refusals
            assert e.code == 2, rest
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: gradmod influence: "), (rest, lines)
        assert re.search(message, lines[0]), (rest, lines[0])
        assert not (folder / "influence.csv").exists()


@pytest.mark.slow
def test_on_the_mnist_cnn_projected_ranks_as_captums_exact(tmp_path):
    """A run of the MNIST CNN on the bundled digits (2 checkpoints): ``--projection 1024`` against
    Captum's exact scores of every training example, Spearman over the top 100 >= 0.9 for each of
    4 test examples."""
    from helpers import FAST, compose_config

    from gradmod.analysis.influence import influence, projection_error
    from gradmod.analysis.self_influence import read_checkpoint, run_data, run_model
    from gradmod.app.config_store import validate
    from gradmod.data import as_float
    from gradmod.run import runner

    cfg = compose_config(*FAST, "trainer.checkpoint_every_steps=20", "trainer.checkpoint_keep=10")
    assert runner.execute(lambda: validate(cfg), tmp_path).status == "ok"
    paths = ckpt.checkpoints(tmp_path / "checkpoints")
    read = [read_checkpoint(p) for p in paths]
    config = read[-1][1]
    data = run_data(config, tmp_path)
    captum = pytest.importorskip("captum.influence")
    from torch.utils.data import TensorDataset

    def load(m, path):
        checkpoint, _ = read_checkpoint(path)
        m.load_state_dict(checkpoint.model)
        m.eval()
        return checkpoint.lr

    build = run_model(config, data)
    tracin = captum.TracInCP(
        build(),
        TensorDataset(as_float(data.train_x), data.train_y),
        [str(p) for p in paths],
        load,
        loss_fn=torch.nn.CrossEntropyLoss(reduction="sum"),
        batch_size=100,
        sample_wise_grads_per_batch=True,
    )
    tests = [0, 1, 2, 3]
    exact = tracin.influence((as_float(data.test_x[tests]), data.test_y[tests]), show_progress=False).double()
    checkpoints = [c for c, _ in read]
    projected = influence(
        build, checkpoints, (data.train_x, data.train_y), (data.test_x[tests], data.test_y[tests]), projection=1024
    )
    error = projection_error(exact, projected, top=100)
    assert error["spearman_min"] >= 0.9, error
