"""Bad input found before training is one line (a ValueError the command line prints with
exit 2), never a traceback from inside torch."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from helpers import TINY_FAKE, compose_config

from gradmod.app.config_store import validate
from gradmod.run import runner
from gradmod.run.folder import endings


def test_mse_with_class_labels_is_one_line(tmp_path):
    cfg = compose_config(*TINY_FAKE, "loss=mse")
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        ending = runner.execute(lambda: validate(cfg), tmp_path / "run")
    assert ending.status == "failed" and ending.exit_code == 2
    line = endings.message(ending.error)
    assert "\n" not in line and line.startswith("loss._target_=torch.nn.MSELoss")
    assert "class" in line and "loss=cross_entropy" in line
    assert not [w for w in said if "target size" in str(w.message)]  # torch's warning: the line says it


def test_sighup_ends_a_run_as_interrupted_with_its_checkpoint(tmp_path, monkeypatch):
    import os
    import signal

    from gradmod.training.callbacks import Callback
    from gradmod.training.trainer import Trainer

    class HangUpAtStep3(Callback):
        def on_step_end(self, trainer) -> None:
            if trainer.step == 3:
                os.kill(os.getpid(), signal.SIGHUP)  # the controlling terminal closed

    fit = Trainer.fit

    def fit_with_hang_up(self, *args, **kwargs):
        self.callbacks.insert(len(self.callbacks) - 1, HangUpAtStep3())  # before StopOnSignal, which is last
        return fit(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "fit", fit_with_hang_up)
    cfg = compose_config(*TINY_FAKE)
    ending = runner.execute(lambda: validate(cfg), tmp_path)

    assert ending.status == "interrupted" and ending.exit_code == 128 + signal.SIGHUP
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["signal"] == "SIGHUP" and summary["steps"] == 3
    assert summary["checkpoint"] and (tmp_path / summary["checkpoint"]).is_file()


class NotPlain:
    """An object a weights-only load refuses."""


def test_an_unreadable_checkpoint_is_one_plain_line(tmp_path):
    import pytest

    from gradmod.run.folder import checkpoint_file as ckpt

    path = ckpt.save(tmp_path, {"step": 5, "thing": NotPlain()}, keep=1)
    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.load(path)
    line = str(e.value)
    assert line.startswith(f"checkpoint {path}: unreadable payload (it holds objects other than tensors")
    assert "NotPlain" in line and "\x1b" not in line and "weights_only" not in line and "\n" not in line
    summary = endings.summary_of(ValueError(f"trainer.resume={path}: {line}"), 1.0)
    assert "\x1b" not in json.dumps(summary)


def test_a_long_glob_is_cut_in_its_line():
    import pytest
    from helpers import tiny_mlp

    from gradmod.hooks import attach

    glob = "layer" * 1000 + "*"
    with pytest.raises(ValueError) as e:
        attach(tiny_mlp(3, 2), {"r": {"params": glob, "transforms": ["zero"]}})
    line = str(e.value)
    assert line.startswith("hooks.r.params: 'layerlayer") and "(5,003 characters) matches no parameter" in line
    assert len(line) < 300


def test_a_compiled_model_under_a_loss_that_differentiates_its_own_gradient_is_one_line(tmp_path):
    """trainer.compile=true with a gradient penalty through the model: refused before training,
    naming the switch (torch.compile runs no double backward)."""
    loss = "loss._target_=tests.support.user_objects.ParamPenaltyLoss"
    ending = runner.execute(lambda: validate(compose_config(*TINY_FAKE, loss, "trainer.compile=true")), tmp_path / "a")
    assert ending.status == "failed" and ending.exit_code == 2
    line = endings.message(ending.error)
    assert "\n" not in line and line.startswith("trainer.compile=true:") and "trainer.compile=false" in line
    assert json.loads((tmp_path / "a" / "summary.json").read_text()).get("steps", 0) == 0  # before the first step


@pytest.mark.parametrize(
    "loss, refused",
    [("ParamPenaltyLoss", True), ("OutputPenaltyLoss", False), ("vector_loss", False)],
)
def test_only_a_gradient_differentiated_again_into_the_model_is_refused_under_compile(loss, refused):
    """A penalty on the output's gradient alone never runs into the model (no double backward of a
    compiled graph): it passes, as a plain loss does; without compile every loss passes."""
    import user_objects

    from gradmod.data import Data
    from gradmod.run import preflight
    from gradmod.training.tasks import Tasks

    torch.manual_seed(0)
    model = user_objects.Tiny()
    (x, y), (tx, ty) = user_objects.data()
    fn = getattr(user_objects, loss)
    tasks = Tasks(fn() if isinstance(fn, type) else lambda o, t: fn(o, t).mean())
    data = Data("user", x, y, tx, ty, num_classes=4)
    preflight.check_model(model, data, tasks, "model", "loss")  # not compiled: no refusal
    if refused:
        with pytest.raises(ValueError, match="trainer.compile=false"):
            preflight.check_model(model, data, tasks, "model", "loss", compiled=True)
    else:
        preflight.check_model(model, data, tasks, "model", "loss", compiled=True)
