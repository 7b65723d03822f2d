"""The user's own objects and the endings they lead to: one line naming what is wrong, the
status ``summary.json`` says, the exit status, and JSON files every parser reads.

The whole table runs through ``train.py`` in one process (``tests/support/cli_driver.py``), on a
40-example dataset and a linear model from ``tests/support/user_objects.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import RESUMABLE, ROOT

from gradmod.app.cli import run

OBJ = "tests.support.user_objects"
BASE = [
    f"data._target_={OBJ}.data",
    "data.batch_size=10",
    "trainer.epochs=1",
    "trainer.device=cpu",
    "trainer.progress=false",
    "trainer.threads=1",
]
TINY = f"model._target_={OBJ}.Tiny"
INF_GRADIENTS = "+hooks.boom={params: '*', transforms: [{name: scale, factor: 1e300}]}"

# (overrides, words the one stderr line must hold, exit status, summary status)
CASES = [
    (
        [TINY, "+model.returns=tuple"],
        [f"model._target_={OBJ}.Tiny", "forward returned a tuple of 2", "one tensor"],
        2,
        "failed",
    ),
    ([TINY, "+model.returns=dict"], ["forward returned a dict of 1", "N x classes"], 2, "failed"),
    ([TINY, "+data.top_label=1000000000"], ["label 1000000000 is >= the 4 outputs", "0..3"], 2, "failed"),
    (["+data.top_label=1000000000"], ["largest label is 1000000000", "model.name=mnist_cnn", "C at most"], 2, "failed"),
    ([TINY, "+data.dtype=float64"], ["train inputs are torch.float64", "torch.uint8", "torch.float32"], 2, "failed"),
    ([TINY, "+data.dtype=int64"], ["train inputs are torch.int64", "x.float()"], 2, "failed"),
    ([TINY, "+data.test_shape=[1,9,9]"], ["train inputs are 1x8x8 but test inputs are 1x9x9"], 2, "failed"),
    (
        [TINY, f"loss._target_={OBJ}.vector_loss", "+loss._partial_=true"],
        [f"loss._target_={OBJ}.vector_loss", "shape (2,) on a check batch of 2 examples", "one scalar tensor"],
        2,
        "failed",
    ),
    (
        [TINY, f"loss._target_={OBJ}.detached_loss", "+loss._partial_=true"],
        ["detached_loss", "does not depend on the model's output", "no gradient"],
        2,
        "failed",
    ),
    (
        [TINY, "plugins=[raising_plugin]"],
        ["plugins: importing 'raising_plugin' raised ZeroDivisionError at", "raising_plugin.py:2"],
        2,
        "failed",
    ),
    (
        [TINY, "plugins=[syntax_plugin]"],
        ["plugins: importing 'syntax_plugin' raised SyntaxError", "line 1"],
        2,
        "failed",
    ),
    (
        [f"model._target_={OBJ}.Nested", "+hooks.r={modules: block, transforms: [zero]}"],
        ["hooks.r.modules", "module 'block' returns dict", "flat tuple"],
        2,
        "failed",
    ),
    (
        [TINY, f"loss._target_={OBJ}.LossThatRaises"],
        ["ValueError: loss went wrong", "user_objects.py:", "traceback is in train.log"],
        1,
        "failed",
    ),
    # signals before training and a second Ctrl-C: interrupted, never a traceback
    ([TINY, "+data.signal_name=TERM"], ["interrupted by SIGTERM before training started"], 143, "interrupted"),
    ([TINY, "+data.signal_name=INT"], ["interrupted by SIGINT before training started"], 130, "interrupted"),
    ([TINY, "+model.signal_name=TERM"], ["interrupted by SIGTERM before training started"], 143, "interrupted"),
    ([TINY, "+model.interrupt_twice_at=3"], ["interrupted by SIGINT after step 1"], 130, "interrupted"),
    # non-finite loss or parameters, under the default trainer.nonfinite=warn
    # infinite gradients (optimizer.lr=inf itself is refused at validation; 1e300 is inf in float32)
    ([TINY, INF_GRADIENTS], ["diverged: a parameter became non-finite", "at step 1"], 3, "diverged"),
    ([TINY, "+model.returns=nans"], ["diverged: the loss and a parameter", "at step 1"], 3, "diverged"),
    ([TINY, f"loss._target_={OBJ}.NanLossAt"], ["diverged: the loss and a parameter", "at step 3"], 3, "diverged"),
]
CAPTURE = [TINY, "capture.gradcam=true", "capture.gradcam_layer=fc"]  # a Linear: N x 4, not N x C x H x W


def _strict(text: str):
    def refuse(name):
        raise ValueError(f"not JSON: {name}")

    return json.loads(text, parse_constant=refuse)


def _drive(tmp_path, cases: list[list[str]]) -> list[dict]:
    (tmp_path / "raising_plugin.py").write_text("# a plugin whose import fails\nx = 1 / 0\n")
    (tmp_path / "syntax_plugin.py").write_text("def broken(:\n")
    lines = "".join(json.dumps([f"hydra.run.dir={tmp_path / str(i)}", *BASE, *ov]) + "\n" for i, ov in enumerate(cases))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path)])}
    env.pop("HYDRA_FULL_ERROR", None)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "support" / "cli_driver.py")],
        input=lines,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    results = [json.loads(ln) for ln in proc.stdout.splitlines()]
    assert len(results) == len(cases), proc.stderr
    return results


def test_each_wrong_object_is_one_line_with_its_status(tmp_path):
    skip_nan = [TINY, f"loss._target_={OBJ}.NanLossAt", "trainer.nonfinite=skip"]
    capture, skipped, unwritable = (tmp_path / str(len(CASES) + k) for k in range(3))
    (unwritable / "train.log").mkdir(parents=True)  # the run's log cannot be opened there
    results = _drive(tmp_path, [ov for ov, *_ in CASES] + [CAPTURE, skip_nan, [TINY]])
    for i, ((ov, words, code, status), res) in enumerate(zip(CASES, results)):
        lines = [ln for ln in res["stderr"].splitlines() if ln.strip()]
        assert res["code"] == code, (ov, res["stderr"])
        assert len(lines) == 1 and "Traceback" not in res["stderr"], (ov, res["stderr"])
        assert lines[0].startswith("interrupted by" if status == "interrupted" else "error: "), (ov, lines)
        for w in words:
            assert w in lines[0], (ov, w, lines[0])
        summary = _strict((tmp_path / str(i) / "summary.json").read_text())
        assert summary["status"] == status, (ov, summary)
        if status == "diverged":
            assert summary["step"] == int(words[-1].split()[-1]) and summary["test_accuracy"] is None
            assert not (tmp_path / str(i) / "model.pt").exists()  # no result of nan numbers
    # the user's ValueError: its traceback in train.log, pointing at the user's line
    log = (tmp_path / "12" / "train.log").read_text()
    assert "Traceback" in log and 'raise ValueError("loss went wrong")' in log
    # Grad-CAM on a layer without a spatial map: refused before training, not after an epoch
    res = results[len(CASES)]
    assert res["code"] == 2 and "capture.gradcam_layer='fc' outputs shape (1, 4)" in res["stderr"], res
    assert not (capture / "metrics.jsonl").exists()
    # trainer.nonfinite=skip: the nan step is skipped, the run is not diverged; its files stay JSON
    res = results[len(CASES) + 1]
    assert res["code"] == 0, res["stderr"]
    summary = _strict((skipped / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["skipped_steps"] == 1
    for path in [*skipped.glob("*.json"), *skipped.glob("*.jsonl")]:
        for line in path.read_text().splitlines() if path.suffix == ".jsonl" else [path.read_text()]:
            _strict(line)
    assert _strict((skipped / "metrics.jsonl").read_text())["train_loss"] is None  # the epoch's mean holds the nan
    # a run folder whose log cannot be written: the path, not "Unable to configure handler 'file'"
    res = results[len(CASES) + 2]
    assert res["code"] == 1, res
    assert res["stderr"].strip() == f"error: cannot write {unwritable / 'train.log'}: Is a directory"


def test_a_restore_error_keeps_its_key_lists(tmp_path, compose_cfg):
    run(compose_cfg(*RESUMABLE, "trainer.epochs=1"), tmp_path)
    cfg = compose_cfg(
        *RESUMABLE,
        "trainer.resume=auto",
        f"model._target_={OBJ}.Tiny",
        "+model.classes=10",
        "data.image_size=8",
        "trainer.resume_accept=[model,data]",
    )
    with pytest.raises(ValueError) as info:
        run(cfg, tmp_path)
    message = str(info.value)
    assert "\n" not in message
    assert 'Missing key(s) in state_dict: "fc.weight", "fc.bias"' in message
    assert 'Unexpected key(s) in state_dict: "conv1.weight"' in message


def test_diverged_ends_with_the_first_bad_step_in_process(tmp_path, compose_cfg):
    """The Python API raises what the command line reports: Diverged with its step."""
    from gradmod.training.nonfinite import Diverged

    with pytest.raises(Diverged) as info:
        run(compose_cfg(*RESUMABLE, "trainer.epochs=1", INF_GRADIENTS), tmp_path)
    assert info.value.step == 1
    summary = _strict((tmp_path / "summary.json").read_text())
    assert summary["status"] == "diverged" and summary["step"] == 1
    assert not list((tmp_path / "checkpoints").glob("step-*.pt"))  # step 4's checkpoint would hold nan


def test_every_ending_is_strict_json(tmp_path):
    from gradmod.run.folder import endings
    from gradmod.training.interrupt import Interrupted
    from gradmod.training.nonfinite import Diverged

    for error, status in [
        (Diverged("diverged at step 7", 7), "diverged"),
        (ValueError("a\nb"), "failed"),
        (Interrupted(15, 0, None, started=False), "interrupted"),
    ]:
        summary = endings.summary_of(error, float("nan"))
        endings.write(tmp_path, summary)
        written = _strict((tmp_path / "summary.json").read_text())
        assert written["status"] == status and written["seconds"] is None
    assert written["signal"] == "SIGTERM" and written["error"] == "interrupted by SIGTERM before training started"
    assert endings.summary_of(ValueError("a\nb"), 0.0)["error"] == "ValueError: a b"  # one line, nothing cut
    endings.write(tmp_path, endings.killed(9, 1.5))
    assert _strict((tmp_path / "summary.json").read_text())["status"] == "killed"
    assert set(endings.STATUSES) == {"ok", "failed", "interrupted", "diverged", "refused", "killed"}
