"""The user's model, data and loss from ``_target_``: the example package through train.py,
the contract's errors, and the loss reaching the trainer."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from helpers import ROOT, run_train

from gradmod.app.cli import run
from gradmod.run.config import DataConfig, LossConfig
from gradmod.run.factories import build_data, build_loss

TINY = [
    "data=fake",
    "data.image_size=28",
    "data.channels=1",
    "data.train_size=60",
    "data.test_size=20",
    "data.batch_size=10",
    "trainer.epochs=1",
    "trainer.device=cpu",
    "trainer.progress=false",
]
EXAMPLE = {"PYTHONPATH": f"{ROOT / 'src'}:{ROOT / 'examples'}"}


def test_example_package_trains_through_train_py(tmp_path):
    proc = run_train(
        tmp_path,
        f"hydra.searchpath=[file://{ROOT / 'examples' / 'conf'}]",
        "experiment=blobs",
        "+hooks=clip",
        "+model.width=8",
        "trainer.epochs=2",
        "trainer.device=cpu",
        "trainer.progress=false",
        env=EXAMPLE,
    )
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["model"] == "my_pkg.nets.TinyNet" and summary["dataset"] == "my_pkg.data.make"
    width, dim, classes = 8, 16, 4  # +model.width=8 reached TinyNet: fc1, bn, fc2
    assert summary["num_params"] == dim * width + width + 2 * width + width * classes + classes
    assert summary["train_size"] == 512 and summary["test_size"] == 128
    assert summary["test_accuracy"] > 1 / classes + 0.2  # it learned the blobs
    assert "fc1.weight" in {row["tensor"] for row in summary["hook_plan"]}, proc.stderr
    # scheduler=cosine over 2 epochs of 16 steps: the rate after each epoch, as torch computes it
    lrs = [json.loads(ln)["lr"] for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    total, base = 32, 0.01
    assert lrs == pytest.approx([base * (1 + math.cos(math.pi * s / total)) / 2 for s in (16, 32)], abs=1e-12)


def _error(compose_cfg, tmp_path, *overrides) -> str:
    with pytest.raises(ValueError) as e:
        run(compose_cfg(*TINY, *overrides), tmp_path)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["model._target_=no_such_pkg.Net"], ["model._target_", "no_such_pkg.Net", "does not import"]),
        (["model._target_=torch.zeros", "+model.size=[3]"], ["model._target_=torch.zeros", "Tensor", "nn.Module"]),
        (["model._target_=torch.nn.Linear", "+model.in_featurs=3"], ["model._target_=torch.nn.Linear", "in_featurs"]),
        (["data._target_=torch.zeros", "+data.size=[3]"], ["data._target_=torch.zeros", "(train, test)"]),
        (["loss._target_=torch.zeros", "+loss.size=[1]"], ["loss._target_", "not callable"]),
        (["+model.width=3"], ["model.width", "allowed", "name"]),  # a shipped model takes no extra keys
    ],
)
def test_target_errors_are_one_line_naming_the_key(compose_cfg, tmp_path, overrides, words):
    msg = _error(compose_cfg, tmp_path, *overrides)
    for word in words:
        assert word in msg, msg


def test_data_target_dataset_and_tensor_pair_become_the_same_tensors(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    from my_pkg.data import Blobs, make

    data = build_data(
        DataConfig(_target_="my_pkg.data.make", args={"n_train": 20, "n_test": 6, "dim": 3}), data_dir="unused", seed=0
    )
    train = Blobs(20, 3, 4, seed=1)  # the dataset form, read item by item
    assert torch.equal(data.train_x, train.x) and torch.equal(data.train_y, train.y)
    assert torch.equal(data.test_x, make(20, 6, 3)[1][0])  # the tensor-pair form, as given
    assert data.train_y.dtype == torch.int64 and data.num_classes == 4


def test_loss_target_reaches_the_trainer(compose_cfg, tmp_path):
    base = run(compose_cfg(*TINY), tmp_path / "base")
    same = run(
        compose_cfg(*TINY, "loss._target_=torch.nn.functional.cross_entropy", "+loss._partial_=true"), tmp_path / "same"
    )
    margin = run(compose_cfg(*TINY, "loss._target_=torch.nn.MultiMarginLoss", "+loss.margin=1.0"), tmp_path / "margin")
    assert same["train_loss"] == base["train_loss"]  # the function equals the default module
    # near-zero logits over 10 classes: cross-entropy ~ ln 10 = 2.3, the multi-class hinge ~ 9/10
    assert base["train_loss"] > 2.0 and 0.5 < margin["train_loss"] < 1.2


def test_data_of_the_wrong_shape_is_one_line(tmp_path, monkeypatch):
    (tmp_path / "bad_data.py").write_text(
        "import torch\n"
        "def flat():\n    return (torch.zeros(4), torch.zeros(4)), (torch.zeros(2, 1), torch.zeros(2))\n"
        "def bools():\n    return [(torch.zeros(3), True)], [(torch.zeros(3), 1)]\n"
        "def scalars():\n    return [1, 2], [3, 4]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    for name, words in (
        ("flat", ["train part", "shape (4,)"]),
        ("bools", ["train part", "class indices", "float targets"]),
        ("scalars", ["train part", "not (input, label) pairs"]),
    ):
        with pytest.raises(ValueError) as e:
            build_data(DataConfig(_target_=f"bad_data.{name}"), data_dir="unused", seed=0)
        assert str(e.value).startswith(f"data._target_=bad_data.{name} must return (train, test)"), str(e.value)
        assert all(w in str(e.value) for w in words) and "\n" not in str(e.value), str(e.value)


def test_build_loss_matches_torch():
    out, y = torch.randn(8, 5), torch.randint(5, (8,))
    assert torch.equal(build_loss(LossConfig())(out, y), F.cross_entropy(out, y))
    smooth = build_loss(LossConfig(args={"label_smoothing": 0.1}))
    assert torch.equal(smooth(out, y), F.cross_entropy(out, y, label_smoothing=0.1))
    nll = build_loss(LossConfig("torch.nn.functional.nll_loss", _partial_=True, args={"reduction": "sum"}))
    assert torch.equal(nll(out.log_softmax(1), y), F.nll_loss(out.log_softmax(1), y, reduction="sum"))


def test_gradcam_builds_its_copy_of_a_target_model():
    from gradmod.data import Data
    from gradmod.models import MnistCNN
    from gradmod.reporting.observe import GradCamProbe
    from gradmod.run.config import ModelConfig
    from gradmod.run.factories import model_factory

    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(256, (20, 1, 28, 28), generator=g, dtype=torch.uint8), torch.arange(20) % 10
    data = Data("t", x, y, x, y)
    cfg = ModelConfig(_target_="gradmod.models.MnistCNN", args={"num_classes": 10})
    model = model_factory(cfg, data)()
    probe = GradCamProbe(model_factory(cfg, data), data, "conv2", 4, torch.device("cpu"))
    assert isinstance(probe.model, MnistCNN) and probe.model is not model
    cam = probe(model)
    assert cam["cams"].shape == (4, 28, 28) and cam["labels"] == [0, 1, 2, 3]
    with torch.no_grad():  # the copy carries the run's weights
        assert cam["preds"] == model(x[:4].float() / 255).argmax(1).tolist()
