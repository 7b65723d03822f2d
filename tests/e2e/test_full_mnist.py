"""The whole of MNIST (60,000 / 10,000), where it is in place: one epoch of the article's run.

``.ci/run`` puts the four IDX files in the checkout's ``data/MNIST/raw`` with the shared fetcher
(``../shared/tools/fetch_full_mnist.sh data``); ``GRADMOD_FULL_MNIST=DIR`` names another folder.
Without the files there is nothing to train on and the test says so.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers import ROOT, compose_config

DATA = Path(os.environ.get("GRADMOD_FULL_MNIST", ROOT / "data"))
IDX = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
in_place = all((DATA / "MNIST" / "raw" / f).is_file() for f in IDX)


@pytest.mark.slow
@pytest.mark.skipif(
    not in_place,
    reason=f"the whole of MNIST is not in {DATA}/MNIST/raw (.ci/run puts it there with "
    "../shared/tools/fetch_full_mnist.sh; GRADMOD_FULL_MNIST=DIR names another folder)",
)
def test_one_epoch_on_the_whole_of_mnist(tmp_path):
    from gradmod.app.cli import run

    overrides = ["+hooks=none", f"data_dir={DATA}", "data.fallback=false", "trainer.epochs=1", "trainer.progress=false"]
    summary = run(compose_config(*overrides, "trainer.device=cpu"), tmp_path)
    assert (summary["dataset"], summary["train_size"], summary["test_size"]) == ("mnist", 60_000, 10_000)
    assert summary["test_accuracy"] >= 0.97
