"""Tasks beyond classification: named losses, outputs and labels, and evaluation with the
configured loss and metric, each checked against a computation by hand from the saved model."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import per_loss_method

from gradmod.app.cli import run
from gradmod.data import TEXT, as_float, load_char_text, load_data, overlay_pairs
from gradmod.labels import Labels
from gradmod.models import CharLM, MultiLeNet, build_model
from gradmod.run.preflight import check_per_loss
from gradmod.training.tasks import Tasks, accuracy

OBJ = "tests.support.task_objects"
CPU = ["trainer.device=cpu", "trainer.progress=false", "trainer.threads=1"]


def _summary(out) -> dict:
    return json.loads((out / "summary.json").read_text())


def _metrics(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_regression_trains_and_reports_its_own_loss(compose_cfg, tmp_path):
    from tests.support.task_objects import regression

    cfg = compose_cfg(
        *CPU,
        f"data._target_={OBJ}.regression",
        "data.batch_size=20",
        "trainer.epochs=15",
        "model._target_=torch.nn.Linear",
        "+model.in_features=4",
        "+model.out_features=1",
        "optimizer.lr=0.05",
    )  # the default loss=auto: float targets get the mean squared error, metric rmse
    summary = run(cfg, tmp_path)
    model = torch.nn.Linear(4, 1)
    model.load_state_dict(torch.load(tmp_path / "model.pt"))
    (_, _), (x, y) = regression()
    with torch.no_grad():
        by_hand = F.mse_loss(model(x), y).item()
    assert summary["test_loss"] == pytest.approx(by_hand, rel=1e-5)
    assert summary["test_loss"] < 0.05  # noise 0.1: the irreducible error is 0.01; ln-style numbers are gone
    assert summary["test_accuracy"] is None
    assert summary["test_metric"] == pytest.approx(math.sqrt(by_hand), rel=1e-5)  # rmse, lower is better
    losses = [m["train_loss"] for m in _metrics(tmp_path)]
    assert losses[-1] < losses[0] / 10


def test_accuracy_on_float_targets_is_one_line(compose_cfg, tmp_path):
    cfg = compose_cfg(
        *CPU,
        f"data._target_={OBJ}.regression",
        "model._target_=torch.nn.Linear",
        "+model.in_features=4",
        "+model.out_features=1",
        "loss=mse",
        "metric=accuracy",
    )
    with pytest.raises(ValueError, match=r"^metric=accuracy needs integer class labels.*float32; use metric=none"):
        run(cfg, tmp_path)
    assert not (tmp_path / "summary.json").exists() or _summary(tmp_path)["status"] == "failed"


def test_char_language_model_learns_the_bundled_text(compose_cfg, tmp_path):
    summary = run(compose_cfg(*CPU, "data=char_text", "model=char_lm", "trainer.epochs=4"), tmp_path)
    data = load_char_text()
    vocab = data.num_classes
    model = CharLM(vocab)
    model.load_state_dict(torch.load(tmp_path / "model.pt"))
    with torch.no_grad():
        logits = model(data.test_x)  # N x chars x T
        loss = F.cross_entropy(logits, data.test_y).item()
        hits = (logits.argmax(1) == data.test_y).float().mean().item()
    assert summary["test_loss"] == pytest.approx(loss, rel=1e-5)
    assert summary["test_accuracy"] == summary["test_metric"] == pytest.approx(hits, abs=1e-6)
    assert summary["test_loss"] < math.log(vocab) - 0.8  # well below a uniform guess over the characters
    assert hits > 0.25  # above the most frequent character's share (the space, about 0.18)
    assert summary["dataset"] == "char_text" and "tasks" not in summary


def test_bundled_text_is_a_few_kilobytes_of_prose():
    text = TEXT.read_text()
    assert 2000 < len(text) < 20000 and text.count(". ") > 20
    data = load_char_text(seq_len=16, stride=4)
    assert data.train_x.shape[1] == 16 and torch.equal(data.train_x[0, 1:], data.train_y[0, :-1])  # shifted by one


def test_multi_mnist_is_made_from_the_digits_and_the_seed():
    a, b, c = load_data("multi_mnist", seed=3), load_data("multi_mnist", seed=3), load_data("multi_mnist", seed=4)
    assert a.train_x.shape == (4000, 1, 36, 36) and a.test_x.shape == (1000, 1, 36, 36)
    assert torch.equal(a.train_x, b.train_x) and torch.equal(a.train_y["right"], b.train_y["right"])
    assert not torch.equal(a.train_x, c.train_x)
    assert isinstance(a.train_y, Labels) and list(a.train_y.keys()) == ["left", "right"]
    same = (a.train_y["left"] == a.train_y["right"]).float().mean().item()
    assert 0.05 < same < 0.2  # random partners: about one pair in ten shows the same digit twice


def test_overlay_puts_each_digit_in_its_corner():
    left, right = np.zeros((1, 28, 28), np.uint8), np.zeros((1, 28, 28), np.uint8)
    left[0, 0, 0], right[0, 27, 27] = 100, 200  # one lit pixel in each image's far corner
    images = np.stack([left, right])
    x, y = overlay_pairs(images, np.array([3, 7]), np.random.default_rng(0))
    for i, (own, partner) in enumerate([(0, 1), (1, 0)]):
        assert (y["left"][i].item(), y["right"][i].item()) == ([3, 7][own], [3, 7][partner])
    r, c = torch.nonzero(x[0, 0] == 100)[0].tolist()  # image 0 on the left: its pixel near the top left
    assert r <= 4 and c <= 4
    r, c = torch.nonzero(x[0, 0] == 200)[0].tolist()  # its partner (image 1) on the right: bottom right
    assert r >= 31 and c >= 31


def test_multi_lenet_has_a_trunk_and_two_heads():
    model = build_model("multi_lenet", image_size=36)
    assert isinstance(model, MultiLeNet)
    names = [n for n, _ in model.named_parameters()]
    assert {n.split(".")[0] for n in names} == {"trunk", "left", "right"}
    out = model(torch.zeros(3, 1, 36, 36))
    assert set(out) == {"left", "right"} and out["left"].shape == (3, 10)
    with pytest.raises(ValueError, match="needs 36x36 images, got 28x28; use data=multi_mnist"):
        build_model("multi_lenet", image_size=28)


def test_multi_mnist_reports_every_task(compose_cfg, tmp_path, caplog):
    caplog.set_level("INFO")
    cfg = compose_cfg(
        *CPU, "data=multi_mnist", "model=multi_lenet", "trainer.epochs=1", "data.n_test=200", "optimizer.lr=0.003"
    )
    summary = run(cfg, tmp_path)
    data = load_data("multi_mnist", seed=cfg.seed, n_test=200)
    model = MultiLeNet()
    model.load_state_dict(torch.load(tmp_path / "model.pt"))
    model.eval()
    with torch.no_grad():
        out = model(as_float(data.test_x))
    tasks = summary["tasks"]
    assert set(tasks) == {"left", "right"}
    for k in ("left", "right"):
        assert tasks[k]["test_loss"] == pytest.approx(F.cross_entropy(out[k], data.test_y[k]).item(), rel=1e-5)
        assert tasks[k]["test_metric"] == pytest.approx(accuracy(out[k], data.test_y[k]).item(), abs=1e-6)
        assert tasks[k]["test_metric"] > 0.25  # learning both digits (chance: 0.1)
    assert summary["test_loss"] == pytest.approx(tasks["left"]["test_loss"] + tasks["right"]["test_loss"], rel=1e-6)
    assert summary["test_accuracy"] == pytest.approx((tasks["left"]["test_metric"] + tasks["right"]["test_metric"]) / 2)
    records = _metrics(tmp_path)
    assert [set(r["tasks"]) for r in records] == [{"left", "right"}] and records[-1]["tasks"] == tasks
    header = (tmp_path / "metrics.csv").read_text().splitlines()[0].split(",")
    assert {"left/test_loss", "left/test_metric", "right/test_metric"} <= set(header)
    log = caplog.text
    assert f"left.test_accuracy {tasks['left']['test_metric']:.4g}" in log  # each task's metric by its name
    assert f"left: loss {tasks['left']['test_loss']:.4f} accuracy {tasks['left']['test_metric']:.4f}" in log


def test_a_loss_of_ones_own_names_its_losses_and_metrics_go_per_task(compose_cfg, tmp_path):
    from tests.support.task_objects import TwoHeads, cls_and_reg, mean_abs_error, two_targets

    cfg = compose_cfg(
        *CPU,
        f"data._target_={OBJ}.two_targets",
        "data.batch_size=20",
        "trainer.epochs=3",
        f"model._target_={OBJ}.TwoHeads",
        f"loss._target_={OBJ}.cls_and_reg",
        "+loss._partial_=true",
        "+loss.per_task=false",
        f"metric={{cls: accuracy, reg: {{_target_: {OBJ}.mean_abs_error, _partial_: true}}}}",
    )
    summary = run(cfg, tmp_path)
    model = TwoHeads()
    model.load_state_dict(torch.load(tmp_path / "model.pt"))
    _, (x, y) = two_targets()
    with torch.no_grad():
        logits, value = model(x)
        losses = cls_and_reg((logits, value), y)
    tasks = summary["tasks"]
    assert tasks["cls"]["test_loss"] == pytest.approx(losses["cls"].item(), rel=1e-5)
    assert tasks["reg"]["test_loss"] == pytest.approx(losses["reg"].item(), rel=1e-5)
    assert tasks["cls"]["test_metric"] == pytest.approx(accuracy(logits, y["cls"]).item(), abs=1e-6)
    assert tasks["reg"]["test_metric"] == pytest.approx(mean_abs_error(value, y["reg"]).item(), rel=1e-5)
    assert summary["test_accuracy"] is None  # one task has no accuracy: no mean of accuracies


def test_a_batch_without_a_tasks_labels_adds_nothing_for_that_task():
    from gradmod.training.tasks import LossByTarget

    out = torch.randn(6, 3, requires_grad=True)
    some = torch.tensor([2, -100, 0, -100, 1, 1])
    torch.testing.assert_close(LossByTarget()(out, some), F.cross_entropy(out, some))
    none = torch.full((6,), -100)
    loss = LossByTarget()(out, none)  # cross-entropy's mean over no example is nan
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(out.grad, torch.zeros(6, 3))


@pytest.mark.skipif(not per_loss_method("upgrad"), reason="a build without the per_loss stage")
def test_a_task_without_labels_in_some_batches_trains_to_the_end(compose_cfg, tmp_path):
    from tests.support.task_objects import TwoHeads, two_targets_few_labelled

    cfg = compose_cfg(
        *CPU,
        f"data._target_={OBJ}.two_targets_few_labelled",
        "data.batch_size=20",
        "trainer.epochs=2",
        f"model._target_={OBJ}.TwoHeads",
        '+hooks.mtl={params: "trunk.*", transforms: [upgrad]}',
    )  # 4 of 120 examples labelled for cls: some batches have none (they were refused, then a nan loss)
    summary = run(cfg, tmp_path)
    assert summary["status"] == "ok"
    model = TwoHeads()
    model.load_state_dict(torch.load(tmp_path / "model.pt"))
    assert all(torch.isfinite(p).all() for p in model.parameters())
    _, (x, y) = two_targets_few_labelled()
    with torch.no_grad():
        logits, _ = model(x)
    assert summary["tasks"]["cls"]["test_loss"] == pytest.approx(F.cross_entropy(logits, y["cls"]).item(), rel=1e-5)


def test_a_loss_that_does_not_fit_the_targets_is_refused_before_training(compose_cfg, tmp_path):
    common = [
        *CPU,
        f"data._target_={OBJ}.regression",
        "model._target_=torch.nn.Linear",
        "+model.in_features=4",
        "+model.out_features=1",
    ]
    cfg = compose_cfg(*common, "loss=cross_entropy", "trainer.epochs=1")
    message = r"^loss._target_=torch.nn.CrossEntropyLoss is a cross-entropy \(class\) loss, and the "
    with pytest.raises(ValueError, match=message) as e:
        run(cfg, tmp_path / "ce")
    assert "\n" not in str(e.value) and "use loss=auto" in str(e.value)
    assert not (tmp_path / "ce" / "metrics.jsonl").exists()


def test_loss_by_target_and_the_fit_checks_by_hand():
    from gradmod.training.tasks import LossByTarget, check_fit

    out = torch.randn(5, 3)
    classes, floats = torch.randint(3, (5,)), torch.randn(5, 3)
    torch.testing.assert_close(LossByTarget()(out, classes), F.cross_entropy(out, classes))
    torch.testing.assert_close(LossByTarget()(out, floats), F.mse_loss(out, floats))
    torch.testing.assert_close(LossByTarget()(out[:, :1], floats[:, 0]), F.mse_loss(out[:, 0], floats[:, 0]))
    check_fit(torch.nn.CrossEntropyLoss(), "a", out, torch.softmax(floats, 1))  # class probabilities: fine
    check_fit(torch.nn.L1Loss(), "r", out, floats)  # a regression loss on float targets: fine
    check_fit(torch.nn.CrossEntropyLoss(), "c", out, classes)
    with pytest.raises(ValueError, match="task 'a' has float targets of shape"):
        check_fit(torch.nn.CrossEntropyLoss(), "a", out, floats)
    with pytest.raises(ValueError, match="is a regression loss, and task 'b' has class indices"):
        check_fit(F.mse_loss, "b", out, classes)
    with pytest.raises(ValueError, match=r"targets of shape \(5,\) for outputs of shape \(5, 3\)"):
        check_fit(torch.nn.MSELoss(), "b", out, floats[:, 0])


def test_several_outputs_with_one_label_tensor_are_one_line():
    tasks = Tasks(F.cross_entropy)
    with pytest.raises(ValueError, match="the model returned outputs for a, b and the data holds one tensor"):
        tasks.losses({"a": torch.zeros(2, 3), "b": torch.zeros(2, 3)}, torch.zeros(2, dtype=torch.long))


def test_per_task_losses_equal_the_losses_by_hand():
    out = {"a": torch.randn(5, 3), "b": torch.randn(5, 4)}
    y = Labels({"a": torch.randint(3, (5,)), "b": torch.randint(4, (5,))})
    losses = Tasks(F.cross_entropy).losses(out, y)
    assert set(losses) == {"a", "b"}
    assert torch.equal(losses["b"], F.cross_entropy(out["b"], y["b"]))
    as_tuple = Tasks(F.cross_entropy).losses((out["a"], out["b"]), y)  # a tuple: the labels' order
    assert torch.equal(as_tuple["a"], losses["a"])


def test_labels_index_split_and_move_together():
    y = Labels({"a": torch.arange(10), "b": torch.arange(10) * 2.0})
    part = y[torch.tensor([3, 1])]
    assert len(part) == 2 and part["b"].tolist() == [6.0, 2.0]
    chunks = y.split(4)
    assert [len(c) for c in chunks] == [4, 4, 2] and chunks[2]["a"].tolist() == [8, 9]
    assert len(y[2:5]) == 3 and y.to("cpu")["a"].device.type == "cpu"
    with pytest.raises(ValueError, match="one length each"):
        Labels({"a": torch.zeros(3), "b": torch.zeros(4)})


def _targets(stage: str) -> list:
    return [SimpleNamespace(rule="surgery", stage=stage)]


def test_a_per_loss_rule_with_one_scalar_loss_is_one_line():
    with pytest.raises(
        ValueError,
        match=r"^hooks.surgery runs at stage per_loss, which combines several losses, "
        r"and loss._target_=x gives one scalar loss; use a model",
    ):
        check_per_loss(_targets("per_loss"), named_losses=False, strategy="single", loss_key="loss._target_=x")
    with pytest.raises(ValueError, match=r"^hooks.surgery runs at stage per_loss, which trainer.strategy=fsdp"):
        check_per_loss(_targets("per_loss"), named_losses=True, strategy="fsdp", loss_key="loss._target_=x")
    check_per_loss(_targets("per_loss"), named_losses=True, strategy="ddp", loss_key="loss._target_=x")
    check_per_loss(_targets("hook"), named_losses=False, strategy="fsdp", loss_key="loss._target_=x")


@pytest.mark.skipif(not per_loss_method("pcgrad"), reason="a build without the per_loss stage")
def test_train_refuses_a_per_loss_rule_on_one_loss_before_training(compose_cfg, tmp_path):
    cfg = compose_cfg(*CPU, "data=mnist_sample", "+hooks.s={params: 'conv*', transforms: [pcgrad]}")
    with pytest.raises(
        ValueError,
        match=r"^hooks.s runs at stage per_loss, which combines several losses, and "
        r"loss._target_=gradmod.training.tasks.LossByTarget gives one scalar loss",
    ):
        run(cfg, tmp_path)
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.slow
@pytest.mark.skipif(not per_loss_method("pcgrad"), reason="a build without the per_loss stage")
def test_multi_mnist_trains_with_a_shipped_per_loss_file(compose_cfg, tmp_path):
    cfg = compose_cfg(
        *CPU,
        "data=multi_mnist",
        "model=multi_lenet",
        "+hooks=pcgrad",
        "trainer.epochs=1",
        "data.n_test=200",
        "optimizer.lr=0.003",
    )
    summary = run(cfg, tmp_path)
    assert summary["hook_plan"] and all(d["stage"] == "per_loss" for d in summary["hook_plan"])
    assert {d["tensor"].split(".")[0] for d in summary["hook_plan"]} == {"trunk"}
    assert min(t["test_metric"] for t in summary["tasks"].values()) > 0.2


def test_gradcam_with_labels_by_task_is_one_line(compose_cfg, tmp_path):
    cfg = compose_cfg(*CPU, "data=multi_mnist", "model=multi_lenet", "capture.gradcam=true")
    with pytest.raises(
        ValueError,
        match=r"^capture.gradcam=true needs one label tensor; data \(multi_mnist\) has "
        r"labels by task \(left, right\)",
    ):
        run(cfg, tmp_path)


def test_a_metric_for_a_task_that_does_not_exist_is_one_line():
    out = {"left": torch.zeros(2, 3), "right": torch.zeros(2, 3)}
    y = Labels({"left": torch.zeros(2, dtype=torch.long), "right": torch.zeros(2, dtype=torch.long)})
    with pytest.raises(ValueError, match=r"^metric.lft: there is no task 'lft'; the tasks are left, right$"):
        Tasks(F.cross_entropy, {"lft": "accuracy"}).describe(out, y)
    assert Tasks(F.cross_entropy, {"left": "none"}).describe(out, y) == "metrics: left=none, right=accuracy"
