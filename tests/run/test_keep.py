"""``data.keep``: a share of the training set, at random or by a score file (GraNd, EL2N from
``scores.csv``, self-influence from ``self_influence.csv``); the kept examples' scores under their
index in the whole set; bad score files refused in one line."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
import torch
from helpers import TINY_FAKE, compose_config, run_train

from gradmod.data import Data
from gradmod.hooks.score_columns import HEADERS, SCORES_FILE, SELF_INFLUENCE_FILE
from gradmod.run.config import FakeDataConfig, KeepConfig
from gradmod.run.keep import keep_share

N = 40


def _data(n: int = N) -> Data:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (n, 1, 28, 28), dtype=torch.uint8, generator=g)
    return Data("toy", x, torch.arange(n) % 10, x[:10], torch.arange(10))


def _scores_csv(folder, data: Data, epochs=(1, 2), seed: int = 0):
    """A scores.csv of every example in ``epochs``, in a shuffled order, with random scores."""
    rng = np.random.default_rng(seed)
    table = {}
    lines = [HEADERS[SCORES_FILE]]
    for e in epochs:
        grand, el2n = rng.random(len(data.train_y)), rng.random(len(data.train_y))
        table[e] = grand, el2n
        for i in rng.permutation(len(data.train_y)):
            lines.append(f"{e},{i},{int(data.train_y[i])},{float(grand[i])!r},{float(el2n[i])!r}")
    (folder / "scores.csv").write_text("\n".join(lines) + "\n")
    return table


def _kept(data: Data, **keep) -> list[int]:
    return keep_share(data, KeepConfig(**keep), seed=7).dataset_index().tolist()


def test_random_share_is_seeded_sorted_and_remembers_its_indices():
    data = _data()
    kept = keep_share(data, KeepConfig(fraction=0.25), seed=7)
    index = kept.train_index.tolist()
    assert len(index) == 10 and index == sorted(index) and len(set(index)) == 10
    assert torch.equal(kept.train_x, data.train_x[kept.train_index])
    assert torch.equal(kept.train_y, data.train_y[kept.train_index])
    assert _kept(data, fraction=0.25) == index  # the run's seed fixes the draw
    assert keep_share(data, KeepConfig(fraction=0.25), seed=8).train_index.tolist() != index
    assert keep_share(data, KeepConfig(), seed=7) is data  # all of it: nothing to do
    again = keep_share(kept, KeepConfig(fraction=0.5), seed=1)  # a share of a share: still whole-set indices
    assert set(again.train_index.tolist()) <= set(index) and len(again.train_index) == 5


@pytest.mark.parametrize("score", ["grand", "el2n"])
@pytest.mark.parametrize("which", ["hardest", "easiest"])
def test_a_scores_csv_keeps_the_hardest_or_easiest_of_an_epoch(tmp_path, score, which):
    data = _data()
    table = _scores_csv(tmp_path, data)
    values = table[2][0 if score == "grand" else 1]
    order = np.argsort(-values if which == "hardest" else values, kind="stable")
    expected = sorted(order[:12].tolist())
    assert _kept(data, fraction=0.3, which=which, score=score, scores=str(tmp_path), epoch=2) == expected
    first = sorted(np.argsort(-table[1][0], kind="stable")[:12].tolist())
    assert _kept(data, fraction=0.3, which="hardest", score="grand", scores=str(tmp_path), epoch=1) == first
    last = sorted(np.argsort(-table[2][0], kind="stable")[:12].tolist())  # epoch null: the file's last
    assert _kept(data, fraction=0.3, which="hardest", score="grand", scores=str(tmp_path)) == last
    assert first != last


@pytest.mark.parametrize("which", ["random", "hardest"])
def test_per_class_keeps_each_class_its_share_by_the_same_order(tmp_path, which):
    sizes = [20, 12, 8, 16, 4]  # examples of classes 0..4
    labels = torch.repeat_interleave(torch.arange(5), torch.tensor(sizes))[
        torch.randperm(60, generator=torch.Generator().manual_seed(2))
    ]
    data = Data("toy", _data(60).train_x, labels, labels[:5], labels[:5])
    table = _scores_csv(tmp_path, data, epochs=(1,))
    scored = {"which": which, "score": "el2n", "scores": str(tmp_path)} if which == "hardest" else {"which": which}
    kept = _kept(data, fraction=0.25, per_class=True, **scored)
    counts = torch.bincount(data.train_y[kept], minlength=5).tolist()
    assert counts == [5, 3, 2, 4, 1]  # a quarter of each class
    if which == "hardest":
        el2n = table[1][1]
        for c in range(5):
            members = np.flatnonzero(data.train_y.numpy() == c)
            top = members[np.argsort(-el2n[members], kind="stable")][: counts[c]]
            assert sorted(top.tolist()) == [i for i in kept if data.train_y[i] == c]
    whole = _kept(data, fraction=0.25, **scored)
    assert len(whole) == 15 and (
        which == "random" or torch.bincount(data.train_y[whole], minlength=5).tolist() != counts
    )


def test_self_influence_csv_by_folder_or_file(tmp_path):
    data = _data()
    rng = np.random.default_rng(1)
    score = rng.random(N)
    rows = "".join(f"{i},{int(data.train_y[i])},{float(score[i])!r}\n" for i in rng.permutation(N))
    (tmp_path / "self_influence.csv").write_text(HEADERS[SELF_INFLUENCE_FILE] + "\n" + rows)
    expected = sorted(np.argsort(-score, kind="stable")[:4].tolist())
    for where in (tmp_path, tmp_path / "self_influence.csv"):
        assert _kept(data, fraction=0.1, which="hardest", score="self_influence", scores=str(where)) == expected


def _refusal(tmp_path, text: str, **keep) -> str:
    (tmp_path / "scores.csv").write_text(text)
    cfg = KeepConfig(**{"fraction": 0.5, "which": "hardest", "score": "el2n", "scores": str(tmp_path), **keep})
    with pytest.raises(ValueError) as e:
        keep_share(_data(4), cfg, seed=0)
    assert "\n" not in str(e.value)
    return str(e.value)


HEADER = HEADERS[SCORES_FILE] + "\n"


def test_bad_score_files_are_one_line_each(tmp_path):
    rows = "".join(f"1,{i},{i},1.0,0.{i}\n" for i in range(4))
    assert "scores of another dataset" in _refusal(tmp_path, HEADER + rows.replace("1,3,3,", "1,7,3,"))
    assert "2 of 4 rows label their example otherwise" in _refusal(
        tmp_path, HEADER + rows.replace("1,1,1,", "1,1,5,").replace("1,2,2,", "1,2,0,")
    )
    assert "scores 3 of the 4 training examples" in _refusal(tmp_path, HEADER + rows.replace("1,3,3,1.0,0.3\n", ""))
    assert "no rows of epoch 3 (data.keep.epoch); its epochs: [1]" in _refusal(tmp_path, HEADER + rows, epoch=3)
    twice = HEADER + rows + "1,2,2,1.0,9.0\n"  # an example drawn twice in an epoch (Poisson): its mean
    (tmp_path / "scores.csv").write_text(twice)
    assert _kept(_data(4), fraction=0.25, which="hardest", score="el2n", scores=str(tmp_path)) == [2]
    assert "holds no scores (its header alone)" in _refusal(tmp_path, HEADER)
    assert "is not scores.csv's table of numbers" in _refusal(tmp_path, HEADER + "1,0,0,x,1\n")
    assert "not finite" in _refusal(tmp_path, HEADER + rows.replace("0.2", "nan"))
    other = HEADERS[SELF_INFLUENCE_FILE]
    assert f"its header is {other!r}" in _refusal(tmp_path, other + "\n0,0,1\n")
    with pytest.raises(ValueError, match="has no self_influence.csv, which self_influence comes from"):
        keep_share(_data(4), KeepConfig(0.5, "hardest", "self_influence", str(tmp_path)), seed=0)
    with pytest.raises(ValueError, match="is neither a folder nor a file"):
        keep_share(_data(4), KeepConfig(0.5, "hardest", "grand", str(tmp_path / "nowhere")), seed=0)


@pytest.mark.parametrize(
    "keep, says",
    [
        ({"fraction": 0.0}, "data.keep.fraction=0.0 must be in (0, 1]"),
        ({"fraction": 1.5}, "data.keep.fraction=1.5 must be in (0, 1]"),
        ({"which": "hard"}, "data.keep.which='hard' is not allowed; allowed: random, hardest, easiest"),
        ({"which": "hardest"}, "data.keep.which=hardest needs data.keep.score"),
        ({"score": "loss"}, "data.keep.score='loss' is not allowed; allowed: grand, el2n, self_influence"),
    ],
)
def test_bad_keep_settings_are_one_line(keep, says):
    with pytest.raises(ValueError, match=says.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        KeepConfig(**keep)


def test_the_command_line_refuses_a_score_file_of_another_dataset(tmp_path):
    (tmp_path / "scores.csv").write_text(HEADER + "1,0,3,1.0,0.5\n")
    keep = ["+prune=el2n", "data.keep.fraction=0.5", f"data.keep.scores={tmp_path}"]
    proc = run_train(tmp_path / "run", *TINY_FAKE, *keep, check=False)
    assert proc.returncode == 2, proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "label their example otherwise than the training set" in errors[0], proc.stderr


def _rows(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def test_a_pruned_run_scores_its_examples_under_their_whole_set_index(tmp_path):
    from gradmod.analysis.score_report import score_run
    from gradmod.app.cli import run
    from gradmod.run.factories import build_data

    tiny = [o for o in TINY_FAKE if not o.startswith("trainer.epochs")]
    keep = ["data.keep.fraction=0.5", "+hooks=scores", "trainer.epochs=1", "trainer.checkpoint_keep=5"]
    run(compose_config(*tiny, *keep), tmp_path)
    whole = build_data(
        FakeDataConfig(name="fake", train_size=60, test_size=20, image_size=28, channels=1), data_dir="data", seed=1234
    )
    expected = keep_share(whole, KeepConfig(fraction=0.5), seed=1234).train_index.tolist()
    assert json.loads((tmp_path / "summary.json").read_text())["train_size"] == 30
    scored = _rows(tmp_path / "scores.csv")
    assert [int(r["index"]) for r in scored] == expected  # sorted by whole-set index, each once
    assert [int(r["label"]) for r in scored] == whole.train_y[expected].tolist()
    score_run(tmp_path, batch_size=8, top=4, device="cpu")
    influence = _rows(tmp_path / "self_influence.csv")
    assert sorted(int(r["index"]) for r in influence) == expected
    assert all(int(r["label"]) == int(whole.train_y[int(r["index"])]) for r in influence)


def test_a_score_chosen_share_is_refused_under_dp_noise(tmp_path):
    pytest.importorskip("opacus", reason="the noisy rule's accountant: pip install 'gradmod[privacy]'")
    from gradmod.app.config_store import validate
    from gradmod.run import dp

    (tmp_path / "scores.csv").write_text(HEADER)
    chosen = [*TINY_FAKE, "+hooks=dp", "+prune=el2n", "data.keep.fraction=0.5", f"data.keep.scores={tmp_path}"]
    with pytest.raises(ValueError, match=r"^data.keep.which=hardest chooses .* use data.keep.which=random under DP"):
        dp.check(validate(compose_config(*chosen)))
    dp.check(validate(compose_config(*TINY_FAKE, "+hooks=dp", "data.keep.fraction=0.5")))  # data-blind: allowed
