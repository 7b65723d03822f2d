"""A persistent Optuna study from the shipped example: ``experiment=clip_optuna`` with
``hydra.sweeper.storage=sqlite:///PATH``, continued by a second invocation; a storage that
cannot be opened is one line."""

from __future__ import annotations

import pytest
from helpers import SWEEP_JOB, run_train
from omegaconf import OmegaConf

from gradmod.app.optuna_storage import StorageError, prepare

TINY = [*SWEEP_JOB, "trainer.epochs=1", "trainer.threads=1", "experiment=clip_optuna"]


def test_a_storage_that_cannot_be_opened_is_one_line(tmp_path):
    url = f"sqlite:///{tmp_path / 'no' / 'such' / 'study.db'}"
    with pytest.raises(StorageError, match=r"^hydra.sweeper.storage=sqlite:///.* cannot be opened: .*unable to open"):
        prepare(url)
    prepare(f"sqlite:///{tmp_path / 'study.db'}")  # a new one: made, stamped
    prepare(f"sqlite:///{tmp_path / 'study.db'}")  # and opened again


@pytest.mark.slow  # two studies of 2 trials (about 2 min on 2 busy cores)
def test_a_second_invocation_continues_the_study(tmp_path):
    optuna = pytest.importorskip("optuna")
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    for sweep in ("first", "second"):
        run_train(
            tmp_path / sweep, *TINY, "hydra.sweeper.n_trials=2", f"hydra.sweeper.storage={storage}", multirun=True
        )
    study = optuna.load_study(study_name="clip_bound_lr", storage=storage)
    assert [t.state.name for t in study.trials] == ["COMPLETE"] * 4  # 2 + 2, across both
    best = OmegaConf.load(tmp_path / "second" / "optimization_results.yaml").best_value
    assert best == study.best_value  # the second sweep's best is the study's, over all four
    bad = run_train(
        tmp_path / "bad", *TINY, "hydra.sweeper.storage=sqlite:////no/such/folder/x.db", multirun=True, check=False
    )
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert (
        bad.stderr.strip()
        .splitlines()[-1]
        .startswith("error: hydra.sweeper.storage=sqlite:////no/such/folder/x.db cannot be opened")
    )
