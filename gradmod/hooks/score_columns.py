"""The columns of the per-example scores, in one place: what the per_sample stage's ``scores``
hand over and the two files built from them. Torch-free, so that the config's checks read it
before torch loads.

* ``take_scores()`` (the stage that keeps scores, ``gradmod.hooks.stages.keeping_scores``):
  one tensor per column of ``KEPT``, one entry per example seen: its index in the whole
  training set, its label, its GraNd and its EL2N;
* ``scores.csv`` (a run with a ``scores`` rule, every epoch): ``epoch`` and ``KEPT``;
* ``self_influence.csv`` (``gradmod scores RUN``): index, label and TracIn self-influence.

``data.keep`` ranks the examples by one score of ``SCORES``, read from its file's column.
"""

from __future__ import annotations

INDEX, LABEL = "index", "label"  # the example's index in the whole training set, its class
GRAND, EL2N = "grand", "el2n"  # the norm of its own loss's gradient, the norm of its error vector
EPOCH, SCORE = "epoch", "score"
KEPT = (INDEX, LABEL, GRAND, EL2N)  # take_scores(): a tensor per column (index, label: int64)

SCORES_FILE = "scores.csv"
SELF_INFLUENCE_FILE = "self_influence.csv"
COLUMNS = {SCORES_FILE: (EPOCH, *KEPT), SELF_INFLUENCE_FILE: (INDEX, LABEL, SCORE)}
HEADERS = {name: ",".join(columns) for name, columns in COLUMNS.items()}  # each file's first line

# data.keep.score -> (the file holding it, its column there)
SCORES = {GRAND: (SCORES_FILE, GRAND), EL2N: (SCORES_FILE, EL2N), "self_influence": (SELF_INFLUENCE_FILE, SCORE)}
