"""``data.keep``: train on a share of the training set, chosen at random or by a score.

Scores rank the examples (Paul et al. 2021, "Deep Learning on a Data Diet"; Pruthi et al. 2020):
GraNd and EL2N from a run with ``+hooks=scores`` (one epoch's rows of its ``scores.csv``, the
last by default), TracIn self-influence from ``gradmod scores RUN`` (``self_influence.csv``).
``hardest`` keeps the highest scores, ``easiest`` the lowest, ``random`` a subset drawn with the
run's seed; over the whole set, or within each class (``per_class``). The kept examples stay in dataset order and remember their index in the whole set
(``Data.train_index``), so a pruned run's own scores name the same examples.

A score file must be the training set's: every example scored once or more, each row's label
the example's; anything else is a ``ValueError`` of one line, before the run takes its folder.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from gradmod.data import Data
from gradmod.hooks.score_columns import EPOCH, HEADERS, INDEX, LABEL, SCORES, SCORES_FILE, SELF_INFLUENCE_FILE
from gradmod.run.config import KeepConfig
from gradmod.run.folder.score_files import one_label_each

log = logging.getLogger(__name__)

ELSEWHERE = "scores of another dataset, or of another split of it (data=mnist_sample splits by seed)"

WRITERS = {SCORES_FILE: "a run with +hooks=scores", SELF_INFLUENCE_FILE: "gradmod scores RUN"}  # each file's writer
# score -> (the file holding it, its column there, what writes that file)
SOURCES = {score: (name, column, WRITERS[name]) for score, (name, column) in SCORES.items()}


def keep_share(data: Data, cfg: KeepConfig, seed: int) -> Data:
    """``data`` with only the training examples ``cfg`` keeps (all of them at fraction 1)."""
    n = len(data.train_y)
    if cfg.which == "random":
        if cfg.fraction == 1:
            return data
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
        how = f"drawn at random (seed {seed})"
    else:
        scores = read_scores(cfg, data.train_y)
        order = torch.sort(scores, descending=cfg.which == "hardest", stable=True).indices
        how = f"the {cfg.which} by {cfg.score} of {cfg.scores}"
    kept = _per_class(order, data.train_y, cfg.fraction) if cfg.per_class else _first(order, cfg.fraction)
    chosen = kept.sort().values  # dataset order: the batches' draw stays the seed's alone
    how += ", per class" if cfg.per_class else ""
    log.info("data.keep: %d of %d training examples, %s", len(chosen), n, how)
    index = chosen if data.train_index is None else data.train_index[chosen]
    return replace(data, train_x=data.train_x[chosen], train_y=data.train_y[chosen], train_index=index)


def _first(order: Tensor, fraction: float) -> Tensor:
    """The first ``fraction`` of ``order``, at least one."""
    return order[: max(1, round(fraction * len(order)))]


def _per_class(order: Tensor, labels: object, fraction: float) -> Tensor:
    """The first ``fraction`` of each class's examples in ``order``."""
    if not one_label_each(labels):
        raise ValueError("data.keep.per_class=true needs one class label per training example")
    ranked = labels[order]
    return torch.cat([_first(order[ranked == c], fraction) for c in torch.unique(labels).tolist()])


def score_file(cfg: KeepConfig) -> Path:
    """The file holding ``cfg.score``: ``cfg.scores`` itself, or the file of that name in the folder."""
    name, _, writer = SOURCES[str(cfg.score)]
    path = Path(str(cfg.scores))
    if path.is_dir():
        path = path / name
        if not path.is_file():
            raise ValueError(f"data.keep.scores={cfg.scores} has no {name}, which {cfg.score} comes from ({writer})")
    elif not path.is_file():
        raise ValueError(f"data.keep.scores={cfg.scores} is neither a folder nor a file")
    return path


def read_scores(cfg: KeepConfig, labels: object) -> Tensor:
    """Each training example's score (float64, by its position in the training set)."""
    if not one_label_each(labels):
        raise ValueError("data.keep by a score needs one class label per training example; use data.keep.which=random")
    path = score_file(cfg)
    name, column, writer = SOURCES[str(cfg.score)]
    header = _header(path)
    if header != HEADERS[name]:
        raise ValueError(
            f"{path}: its header is {header!r}; {cfg.score} comes from {name} ({writer}), "
            f"whose header is {HEADERS[name]!r}"
        )
    try:
        with warnings.catch_warnings():  # a header alone: no rows, refused below
            warnings.simplefilter("ignore", UserWarning)
            table = np.loadtxt(path, delimiter=",", skiprows=1, ndmin=2, dtype=np.float64)
    except ValueError as e:  # a cell that is not a number, a row of another length
        raise ValueError(f"{path} is not {name}'s table of numbers: {e}") from None
    if len(table) == 0:
        raise ValueError(f"{path} holds no scores (its header alone)")
    columns = {c: table[:, i] for i, c in enumerate(header.split(","))}
    if name == SCORES_FILE:  # one epoch's rows: the weights move during an epoch, so epochs are not mixed
        epoch = columns[EPOCH].max() if cfg.epoch is None else cfg.epoch
        rows = columns[EPOCH] == epoch
        if not rows.any():
            epochs = sorted({int(e) for e in columns[EPOCH]})
            raise ValueError(f"{path} has no rows of epoch {cfg.epoch} (data.keep.epoch); its epochs: {epochs}")
        columns = {c: v[rows] for c, v in columns.items()}
    return _by_example(path, columns[INDEX], columns[LABEL], columns[column], labels.cpu())


def _by_example(path: Path, index: np.ndarray, label: np.ndarray, value: np.ndarray, labels: Tensor) -> Tensor:
    """The mean of each example's rows (Poisson sampling may draw one twice in an epoch), checked
    against the training set's labels."""
    n = len(labels)
    if index.min() < 0 or index.max() >= n or (index != np.round(index)).any():
        raise ValueError(
            f"{path} holds indices {index.min():g} to {index.max():g} but the training set has {n} examples: "
            f"{ELSEWHERE}"
        )
    at = torch.from_numpy(index.astype(np.int64))
    wrong = torch.from_numpy(label.astype(np.int64)) != labels[at]
    if wrong.any():
        i = int(wrong.nonzero()[0])
        raise ValueError(
            f"{path}: {int(wrong.sum())} of {len(at)} rows label their example otherwise than the training set "
            f"(index {int(at[i])}: {int(label[i])} there, {int(labels[at[i]])} here): {ELSEWHERE}"
        )
    if not np.isfinite(value).all():
        raise ValueError(f"{path} holds scores that are not finite (index {int(index[~np.isfinite(value)][0])})")
    count = torch.bincount(at, minlength=n)
    if (count == 0).any():
        raise ValueError(
            f"{path} scores {int((count > 0).sum())} of the {n} training examples; every one needs a score "
            "(score the whole training set)"
        )
    total = torch.zeros(n, dtype=torch.float64).index_add_(0, at, torch.from_numpy(value))
    return total / count


def _header(path: Path) -> str:
    with open(path) as f:
        return f.readline().strip()
