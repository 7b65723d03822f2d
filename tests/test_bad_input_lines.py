"""Bad input found before training is one line (a ValueError the command line prints with
exit 2), never a traceback from inside torch."""

from __future__ import annotations

import warnings

from helpers import TINY_FAKE, compose_config

from gradmod.app.config_store import validate
from gradmod.run import endings, runner


def test_mse_with_class_labels_is_one_line(tmp_path):
    cfg = compose_config(*TINY_FAKE, "loss=mse")
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        ending = runner.execute(lambda: validate(cfg), tmp_path / "run")
    assert ending.status == "failed" and ending.exit_code == 2
    line = endings.message(ending.error)
    assert "\n" not in line and line.startswith("loss._target_=torch.nn.MSELoss: the loss fails")
    assert "class labels" in line and "loss=cross_entropy" in line
    assert not [w for w in said if "target size" in str(w.message)]  # torch's warning: the line says it
