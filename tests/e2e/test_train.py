"""End to end through Hydra on the CPU and the bundled sample."""

import json
import re
from pathlib import Path

import pytest
import torch
from helpers import CONF, FAST, per_loss_method, run_train

from gradmod.app.cli import run
from gradmod.hooks import attach, load_rules
from gradmod.hooks.rules import shared as shared_params
from gradmod.models import build_model

HOOK_FILES = sorted(p.stem for p in (CONF / "hooks").glob("*.yaml"))
MODEL_FILES = sorted(p.stem for p in (CONF / "model").glob("*.yaml"))


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_required_hook_configs_exist():
    assert {"clip", "zero", "min_zero", "log"} <= set(HOOK_FILES)


def _rules(hooks: str) -> list[dict]:
    return list(load_rules(CONF / "hooks" / f"{hooks}.yaml").values())


def _per_loss(hooks: str) -> bool:
    """A hook file of the per_loss stage: it combines the losses of multi_lenet's heads (on its
    trunk, or, a loss weighting, on every parameter)."""
    rules = _rules(hooks)
    return bool(rules) and all(all(per_loss_method(t) for t in rule["transforms"]) for rule in rules)


def _applies(hooks: str, model: str) -> bool:
    """per_loss files select multi_lenet's trunk only; agc leaves the output layer (fc.*, l1.*)
    out, and multi_lenet's are its heads, named by task; sam_on moves a ResNet's BatchNorm layers;
    grl reverses the dann model's domain gradient; min_zero is the articles' hook on conv weights."""
    if _per_loss(hooks):
        return model == "multi_lenet"
    if hooks == "curvature":  # it observes the loss: the trainer runs it, attach refuses it (below)
        return False
    if hooks == "sam_on":
        return model.startswith("resnet")
    if hooks == "grl":
        return model == "dann"
    if hooks == "min_zero" and model == "tiny_gpt":  # a transformer: no conv layers
        return False
    if hooks == "orthogonalize":  # "*.weight": the norm layers' weights are vectors, refused
        return model not in ("resnet18", "resnet50", "tiny_gpt")
    if hooks == "gradual_unfreeze":  # the MNIST CNN's layers by name
        return model == "mnist_cnn"
    return not (hooks == "agc" and model == "multi_lenet")


PAIRS = [(h, m) for h in HOOK_FILES for m in MODEL_FILES if _applies(h, m)]


@pytest.mark.parametrize("hooks", [h for h in HOOK_FILES if _per_loss(h)])
def test_a_per_loss_file_on_a_one_head_model_is_one_clear_error(compose_cfg, hooks, tmp_path):
    cfg = compose_cfg(f"+hooks={hooks}", "model=mnist_cnn", "data=mnist_sample", "trainer.device=cpu")
    if all(rule["params"] == "trunk.*" for rule in _rules(hooks)):
        net = build_model(cfg.model.name, in_channels=1, num_classes=10, image_size=28, norm=cfg.model.norm)
        with pytest.raises(ValueError, match=r"'trunk\.\*' matches no parameter .* names look like: conv1\.weight"):
            attach(net, cfg.hooks, stage=cfg.trainer.hook_stage)
    else:  # every parameter: the one scalar loss is refused before training
        with pytest.raises(ValueError, match=rf"^hooks.{hooks} runs at stage per_loss, .* gives one scalar loss"):
            run(cfg, tmp_path)
        assert not (tmp_path / "metrics.jsonl").exists()


def test_sam_on_a_model_without_batchnorm_is_one_clear_error(compose_cfg):
    cfg = compose_cfg("+hooks=sam_on", "model=mnist_cnn")
    net = build_model(cfg.model.name, in_channels=1, num_classes=10, image_size=28, norm=cfg.model.norm)
    with pytest.raises(ValueError, match=r"^hooks.sam_on.params: '\*bn\*' matches no parameter [^\n]*$"):
        attach(net, cfg.hooks, stage=cfg.trainer.hook_stage)


@pytest.mark.parametrize("hooks,model", PAIRS)
def test_every_hook_config_composes_and_attaches_to_every_model(compose_cfg, hooks, model):
    norm = ["model.norm=group"] if hooks in ("dp", "scores") else []  # per-example gradients: no BatchNorm
    cfg = compose_cfg(f"+hooks={hooks}", f"model={model}", *norm)
    net = build_model(
        cfg.model.name,
        in_channels=1,
        num_classes=10,
        image_size=36 if model == "multi_lenet" else 28,
        norm=cfg.model.norm,
    )
    if _per_loss(hooks):  # what @shared stands for, found as the trainer finds it: one forward of the tasks
        size = 36 if model == "multi_lenet" else 28
        shared_params.find(net, {k: v.sum() for k, v in net(torch.randn(2, 1, size, size)).items()})
    # The run's length, as the trainer gives it: schedules and windows in ep/dur need it.
    with attach(net, cfg.hooks, stage=cfg.trainer.hook_stage, total_steps=100, steps_per_epoch=10) as hs:
        if hooks == "none":  # the baseline: no rules at all
            assert not cfg.hooks and not hs.chains
        else:
            assert hs.chains, f"hooks={hooks} selects nothing on {model}"


def test_the_curvature_config_attached_as_transforms_is_one_clear_error(compose_cfg):
    cfg = compose_cfg("+hooks=curvature")
    net = build_model(cfg.model.name, in_channels=1, num_classes=10, image_size=28, norm=cfg.model.norm)
    with pytest.raises(ValueError, match=r"curvature is not a gradient transform: .* gradmod.hooks.curvature\("):
        attach(net, cfg.hooks, stage=cfg.trainer.hook_stage)


def test_hook_configs_compose_together_and_overrides_reach_the_rule(compose_cfg):
    cfg = compose_cfg("+hooks=[clip,log]", "hooks.clip.transforms.0.max=0.1")
    assert list(cfg.hooks) == ["clip", "log"]
    assert cfg.hooks.clip.transforms[0] == {"name": "clamp", "min": -0.01, "max": 0.1}
    plain = compose_cfg()
    assert dict(plain.hooks) == {}
    assert (plain.data.batch_size, plain.trainer.epochs, plain.optimizer._target_) == (100, 10, "torch.optim.Adam")


def test_run_writes_the_run_folder(compose_cfg, tmp_path):
    cfg = compose_cfg(
        *FAST, "trainer.epochs=2", "+hooks=[clip,log]", "trainer.log_every=10", f"data_dir={tmp_path / 'data'}"
    )
    summary = run(cfg, tmp_path)
    assert {p.name for p in tmp_path.iterdir()} >= {
        "summary.json",
        "metrics.jsonl",
        "hook_plan.json",
        "model.pt",
        "curves.png",
        "grad_stats.jsonl",
    }
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk == json.loads(json.dumps(summary))
    assert on_disk["dataset"] == "mnist_sample" and on_disk["device"] == "cpu" and on_disk["epochs"] == 2
    assert on_disk["num_params"] == 25_258 and on_disk["train_size"] == 4000 and on_disk["test_size"] == 1000
    assert [d["tensor"] for d in on_disk["hook_plan"]][:2] == ["conv1.weight", "conv1.bias"]

    metrics = read_jsonl(tmp_path / "metrics.jsonl")
    assert [m["epoch"] for m in metrics] == [1, 2]
    assert metrics[1]["train_loss"] < metrics[0]["train_loss"]
    assert metrics[-1]["test_accuracy"] == on_disk["test_accuracy"] > 0.7
    for m in metrics:
        assert m["seconds"] >= m["train_seconds"] > 0 and m["eval_seconds"] > 0
        # clip runs before log in config order, so log sees clamped gradients.
        assert -0.01 <= m["grad_stats"]["l1.weight"]["min"] <= m["grad_stats"]["l1.weight"]["max"] <= 0.01

    stats = read_jsonl(tmp_path / "grad_stats.jsonl")
    steps = [s["step"] for s in stats]
    assert steps[:4] == [10, 20, 30, 40] and steps[-1] == 80  # 40 steps per epoch, plus epoch ends
    assert sum(s["stats"]["conv1.bias"]["calls"] for s in stats) == 80  # every step seen exactly once

    state = torch.load(tmp_path / "model.pt", weights_only=True)
    assert set(state) == {"conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias", "l1.weight", "l1.bias"}
    assert (tmp_path / "curves.png").stat().st_size > 5000


def test_runs_repeat_exactly_with_the_same_seed(compose_cfg, tmp_path):
    cfg = compose_cfg(*FAST, "+hooks=clip", f"data_dir={tmp_path / 'data'}")
    a = run(cfg, tmp_path / "a")
    b = run(cfg, tmp_path / "b")
    assert a["train_loss"] == b["train_loss"] and a["test_accuracy"] == b["test_accuracy"]
    wa, wb = (torch.load(tmp_path / d / "model.pt", weights_only=True) for d in "ab")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_zero_hook_run_keeps_biases_at_init(compose_cfg, tmp_path):
    cfg = compose_cfg(*FAST, "+hooks=zero", "seed=7", f"data_dir={tmp_path / 'data'}")
    run(cfg, tmp_path)
    torch.manual_seed(7)
    init = build_model("mnist_cnn").state_dict()
    trained = torch.load(tmp_path / "model.pt", weights_only=True)
    for name in init:
        assert torch.equal(init[name], trained[name]) == name.endswith("bias"), name


def test_cli_run_prints_plan_and_falls_back_offline(tmp_path):
    proc = run_train(
        tmp_path, "trainer.epochs=1", "trainer.progress=false", "+hooks=clip", "hooks.clip.transforms.0.max=0.1"
    )
    log = proc.stdout + proc.stderr
    assert "WARNING" in log and "bundled 5,000-digit sample" in log
    assert "clamp(min=-0.01, max=0.1)" in log
    assert re.search(r"epoch 1/1: train_loss \S+ test_loss \S+ test_accuracy \S+", proc.stdout)  # not a terminal
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["dataset"] == "mnist_sample"
    assert summary["hook_plan"][0]["transforms"] == ["clamp(min=-0.01, max=0.1)"]


def test_cli_bad_input_is_one_line_and_exit_2(tmp_path):
    proc = run_train(tmp_path, *FAST[1:], "data=mnist", "data.fallback=false", check=False)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "data.fallback=true" in errors[0]

    proc = run_train(tmp_path / "b", *FAST, "+hooks=clip", "hooks.clip.params=fc*", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "error: hooks.clip.params: 'fc*' matches no parameter" in proc.stderr


@pytest.mark.slow  # tests/e2e/test_sweeps.py sweeps through train.py in the default suite
def test_multirun_sweeps_hook_configs(tmp_path):
    run_train(tmp_path, *FAST, "trainer.epochs=1", "+hooks=clip,zero,min_zero,log", multirun=True)
    summaries = sorted(tmp_path.glob("*/summary.json"))
    assert len(summaries) == 4
    rules = {json.loads(p.read_text())["hook_plan"][0]["rule"] for p in summaries}
    assert rules == {"clip", "zero", "min_zero", "log"}


@pytest.mark.slow
def test_default_clip_run_reaches_95_percent(tmp_path):
    """The README's promise: `python train.py +hooks=clip` with its defaults, >= 95% on the sample."""
    run_train(tmp_path, "+hooks=clip", "trainer.progress=false")
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["epochs"] == 10 and summary["dataset"] == "mnist_sample"
    assert summary["test_accuracy"] >= 0.95


def test_what_a_run_opened_is_closed_when_opening_a_later_file_fails(compose_cfg, tmp_path, monkeypatch):
    import gradmod.run.runner as run_mod

    closed = []

    class Files(run_mod.RunFiles):
        def close(self):
            closed.append(self.out)
            super().close()

    monkeypatch.setattr(run_mod, "RunFiles", Files)
    (tmp_path / "grad_stats.jsonl").mkdir()  # opening the statistics file fails...
    with pytest.raises(IsADirectoryError):
        run(compose_cfg(*FAST, "+hooks=log", f"data_dir={tmp_path / 'data'}"), tmp_path)
    assert closed == [tmp_path]  # ...after metrics.jsonl was opened: it was closed again
    assert (tmp_path / "metrics.jsonl").exists()


def test_trainer_threads_holds_for_the_run_only(compose_cfg, tmp_path):
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        summary = run(
            compose_cfg(*FAST, "trainer.threads=1", "data.n_test=4000", f"data_dir={tmp_path / 'data'}"), tmp_path
        )
        assert summary["threads"] == 1
        assert torch.get_num_threads() == 3  # the next job of an in-process sweep gets the old count
    finally:
        torch.set_num_threads(before)
