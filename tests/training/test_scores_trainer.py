"""``scores`` in the Trainer and in a run: every example once an epoch under its dataset index,
training unchanged, ``scores.csv`` kept across a resume, the ranks' rows gathered under DDP."""

from __future__ import annotations

import csv
import json

import pytest
import torch
from helpers import RESUMABLE, compose_config, free_port, spawn_ranks

from gradmod.hooks import attach
from gradmod.hooks.score_columns import COLUMNS, SCORES_FILE
from gradmod.models import MnistCNN
from gradmod.training.trainer import Trainer, TrainerSettings

SCORES = {"s": {"params": "*", "stage": "per_sample", "transforms": ["scores"]}}


def _data(n: int = 30):
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, 256, (n, 1, 28, 28), generator=g, dtype=torch.uint8), torch.randint(
        0, 10, (n,), generator=g
    )


def _trainer(model, hooks, **settings) -> Trainer:
    return Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        TrainerSettings(log_every=2**62, **settings),
        hooks=hooks,
        generator=torch.Generator().manual_seed(5),
    )


@pytest.mark.parametrize(
    "settings", [{"batch_size": 8}, {"batch_size": 4, "accumulate": 2}, {"batch_size": 8, "loader_workers": 0}]
)
def test_each_example_once_an_epoch_and_training_unchanged(settings):
    x, y = _data()
    torch.manual_seed(0)
    model, plain = MnistCNN(), MnistCNN()
    plain.load_state_dict(model.state_dict())
    hooks = attach(model, SCORES)
    trainer = _trainer(model, hooks, **settings)
    for _ in range(2):
        trainer.train_epoch(x, y)
        rows = hooks.stage("per_sample").take_scores()
        assert sorted(rows["index"].tolist()) == list(range(len(y)))
        assert rows["label"].tolist() == y[rows["index"]].tolist()
        assert (rows["grand"] > 0).all() and ((rows["el2n"] >= 0) & (rows["el2n"] <= 2**0.5)).all()
    bare = _trainer(plain, None, **settings)
    bare.train_epoch(x, y)
    bare.train_epoch(x, y)
    for (n, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=n)


def test_poisson_batches_are_scored_under_their_indices():
    x, y = _data()
    hooks = attach(MnistCNN(), SCORES)
    trainer = _trainer(hooks.stage("per_sample").model, hooks, batch_size=6, sampling="poisson")
    trainer.train_epoch(x, y)
    rows = hooks.stage("per_sample").take_scores()
    assert 0 < len(rows["index"]) and rows["label"].tolist() == y[rows["index"]].tolist()


def test_the_command_line_rule_form_composes():
    from gradmod.app.config_store import validate

    cfg = validate(compose_config("+hooks.s={params: '*', stage: per_sample, transforms: [scores]}"))
    assert cfg.hooks["s"]["transforms"] == ["scores"] and cfg.hooks["s"]["stage"] == "per_sample"


def _scores_csv(folder):
    with open(folder / "scores.csv") as f:
        return list(csv.DictReader(f))


def _run(out, *overrides):
    from gradmod.app.cli import run

    return run(compose_config(*overrides), out)


def test_a_run_writes_scores_csv_and_a_resume_keeps_it(tmp_path):
    base = [*(o for o in RESUMABLE if not o.startswith("+hooks")), "+hooks=scores", "trainer.checkpoint_keep=10"]
    full = tmp_path / "full"
    _run(full, *base)
    rows = _scores_csv(full)
    assert tuple(rows[0]) == COLUMNS[SCORES_FILE]
    for epoch in (1, 2):  # every one of the 60 training examples once an epoch, sorted by index
        assert [int(r["index"]) for r in rows if r["epoch"] == str(epoch)] == list(range(60))
    resumed = tmp_path / "resumed"  # from the checkpoint after step 4 (mid-epoch 1): rows of steps 1-4 in it
    _run(resumed, *base, f"trainer.resume={full / 'checkpoints' / 'step-000000004.pt'}")
    again = _scores_csv(resumed)
    assert [(r["epoch"], r["index"], r["label"]) for r in again] == [(r["epoch"], r["index"], r["label"]) for r in rows]
    for a, b in zip(again, rows):
        assert float(a["grand"]) == pytest.approx(float(b["grand"]), rel=1e-5)
    in_place = tmp_path / "in_place"  # resumed in its own folder after epoch 1: epoch 1's rows kept, 2's redone
    once = [o for o in base if not o.startswith("trainer.epochs")]
    _run(in_place, *once, "trainer.epochs=1")
    _run(in_place, *once, "trainer.epochs=2", "trainer.resume=auto")
    assert [(r["epoch"], r["index"]) for r in _scores_csv(in_place)] == [(r["epoch"], r["index"]) for r in rows]
    assert json.loads((in_place / "summary.json").read_text())["epochs"] == 2


# -- DDP: 2 gloo processes -------------------------------------------------------------------


def _ddp_worker(rank: int, world: int, port: int, out: str) -> None:
    import os

    from gradmod.run.folder.scores_csv import gathered
    from gradmod.training.distributed.strategy import Dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    dist = Dist.from_env("ddp", torch.device("cpu"))
    try:
        torch.manual_seed(0)
        model = MnistCNN()
        hooks = attach(model, SCORES)
        x, y = _data()
        trainer = Trainer(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            TrainerSettings(batch_size=4, log_every=2**62),
            hooks=hooks,
            dist=dist,
            net=dist.wrap(model),
            generator=torch.Generator().manual_seed(5),
        )
        trainer.train_epoch(x, y)
        torch.save(gathered(hooks.stage("per_sample").take_scores(), world), os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.close()


@pytest.mark.slow
def test_ddp_ranks_scores_are_gathered_by_index(tmp_path):
    # 2 ranks with batch 4 = one process with batch 8: the same examples, the same norms
    spawn_ranks(_ddp_worker, 2, free_port(), str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    x, y = _data()
    torch.manual_seed(0)
    model = MnistCNN()
    hooks = attach(model, SCORES)
    _trainer(model, hooks, batch_size=8).train_epoch(x, y)
    from gradmod.run.folder.scores_csv import gathered

    single = gathered(hooks.stage("per_sample").take_scores(), 1)
    for k in ("index", "label"):
        assert ranks[0][k].tolist() == ranks[1][k].tolist() == single[k].tolist()
    torch.testing.assert_close(ranks[0]["grand"], single["grand"], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(ranks[0]["el2n"], single["el2n"], rtol=1e-4, atol=1e-6)
