"""The headers of the two per-example score files a run folder may hold: ``scores.csv`` (written
each epoch by ``gradmod.run.folder.scores_csv``) and ``self_influence.csv`` (``gradmod scores RUN``,
``gradmod.analysis.score_report``); ``data.keep`` reads both (``gradmod.run.keep``)."""

from torch import Tensor

SCORES_CSV = "epoch,index,label,grand,el2n"
SELF_INFLUENCE_CSV = "index,label,score"
HEADERS = {"scores.csv": SCORES_CSV, "self_influence.csv": SELF_INFLUENCE_CSV}


def one_label_each(labels: object) -> bool:
    """One class index per example: a 1-d integer tensor (what a score file's ``label`` column holds)."""
    return isinstance(labels, Tensor) and labels.dim() == 1 and not labels.is_floating_point()
