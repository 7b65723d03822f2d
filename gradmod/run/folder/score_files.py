"""What the two per-example score files a run folder may hold share: ``scores.csv`` (written each
epoch by ``gradmod.run.folder.scores_csv``) and ``self_influence.csv`` (``gradmod scores RUN``,
``gradmod.analysis.score_report``), both read by ``data.keep`` (``gradmod.run.keep``). Their
columns and headers are ``gradmod.hooks.score_columns``'."""

from torch import Tensor


def one_label_each(labels: object) -> bool:
    """One class index per example: a 1-d integer tensor (what a score file's ``label`` column holds)."""
    return isinstance(labels, Tensor) and labels.dim() == 1 and not labels.is_floating_point()
