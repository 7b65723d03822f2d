"""TracIn influence of training examples on test examples (Pruthi et al. 2020, "TracInCP").

For checkpoints c with learning rates ``lr_c``, training example i scores on test example t
``sum_c lr_c g_t(w_c) . g_i(w_c)``: ``g`` the gradient of the example's own cross-entropy loss
over the parameters some globs select (Captum's ``layers=``), the model in eval mode, the run's
hook rules not applied (the plain loss gradient, as Captum's ``TracInCP.influence`` takes it, the
reference the tests compare with). A positive score: a step on i lowered t's loss (a proponent);
a negative one raised it (an opponent).

Each example's gradient comes a batch at a time from ``gradmod.analysis.example_grads`` (the
layers' per-example forms, else ``torch.func.vmap`` of ``grad``); the test examples' are formed
once per checkpoint and the training set streams past them. With
``projection=d`` both sides are multiplied by one Gaussian matrix (``P x d``, entries of variance
``1/d``, drawn once from ``seed``): the dot products are kept in expectation
(Johnson-Lindenstrauss) with a relative error of about ``sqrt(2/d)``, and the scores cost ``d``
instead of ``P`` per pair.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor, nn

from gradmod.analysis.example_grads import ExampleGrads, channels_last
from gradmod.analysis.self_influence import Checkpoint
from gradmod.data import as_float
from gradmod.hooks.rules import globs


def chosen(model: nn.Module, params: Any) -> list[str]:
    """The parameter names the globs select (model order); one line for a glob matching nothing."""
    names = [n for n, _ in model.named_parameters()]
    picked = globs.matching("--params", params, names, "parameter", globs.param_kinds(model))
    return [n for n in names if n in picked]


def dots(a: list[Tensor], b: list[Tensor]) -> Tensor:
    """``[rows of a, rows of b]``: the rows' dot products over the blocks together."""
    out = a[0] @ b[0].T
    for p, q in zip(a[1:], b[1:]):
        out.addmm_(p, q.T)
    return out


def project(blocks: list[Tensor], proj: Tensor) -> list[Tensor]:
    """The gradients (blocks along ``P``) times ``proj`` (``[P, d]``): one ``[rows, d]`` block."""
    rows = proj.split([b.shape[1] for b in blocks])
    out = blocks[0] @ rows[0]
    for b, r in zip(blocks[1:], rows[1:]):
        out.addmm_(b, r)
    return [out]


def projection_matrix(size: int, d: int, seed: int, like: Tensor) -> Tensor:
    """``[size, d]`` Gaussian entries of variance ``1/d``, from ``seed`` (drawn on the host)."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(size, d, generator=gen) / d**0.5).to(like.device, like.dtype)


def influence(
    build: Callable[[], nn.Module],
    checkpoints: list[Checkpoint],
    train: tuple[Tensor, Tensor],
    test: tuple[Tensor, Tensor],
    *,
    params: Any = "*",
    projection: int | None = None,
    seed: int = 0,
    batch_size: int = 100,
    device: torch.device | None = None,
    progress: Callable[[int, Checkpoint, int], None] | None = None,
) -> Tensor:
    """``[len(test), len(train)]`` float64: TracIn scores over ``checkpoints``; ``progress(k, c,
    done)``: checkpoint ``k`` (from 0) has ``done`` training examples scored (0 as it starts)."""
    device = device or torch.device("cpu")
    (train_x, train_y), (test_x, test_y) = train, test
    scores = torch.zeros(len(test_y), len(train_y), dtype=torch.float64)
    proj: Tensor | None = None
    for k, c in enumerate(checkpoints):
        if progress is not None:
            progress(k, c, 0)
        model = build()
        model.load_state_dict(c.model)
        model.to(device).eval()
        channels_last(model)
        names = chosen(model, params)
        per_example = ExampleGrads(model, names)
        gt = per_example(as_float(test_x.to(device)), test_y.to(device))
        size = sum(b.shape[1] for b in gt)
        if projection is not None and (proj is None or proj.shape[0] != size):
            proj = projection_matrix(size, projection, seed, gt[0])  # one for every checkpoint: drawn once
        gt = gt if proj is None else project(gt, proj)
        for start in range(0, len(train_y), batch_size):
            stop = min(start + batch_size, len(train_y))
            g = per_example(as_float(train_x[start:stop].to(device)), train_y[start:stop].to(device))
            g = g if proj is None else project(g, proj)
            scores[:, start:stop] += c.lr * dots(gt, g).double().cpu()
            if progress is not None:
                progress(k, c, stop)
    return scores


def spearman(a: Tensor, b: Tensor) -> float:
    """The rank correlation of two score vectors (ties broken by position)."""
    ra = torch.argsort(torch.argsort(a)).double()
    rb = torch.argsort(torch.argsort(b)).double()
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra @ rb) / (ra.norm() * rb.norm()))


def projection_error(exact: Tensor, projected: Tensor, top: int = 100) -> dict[str, float]:
    """Per test example (rows), over the ``top`` training examples of largest exact |score| (the
    proponents and opponents that matter): the Spearman correlation, and the relative RMS error."""
    rhos, errors = [], []
    for e, p in zip(exact, projected):
        keep = torch.argsort(e.abs(), descending=True)[: min(top, len(e))]
        rhos.append(spearman(e[keep], p[keep]))
        errors.append(float((e[keep] - p[keep]).norm() / e[keep].norm().clamp_min(1e-30)))
    return {"spearman_min": min(rhos), "spearman_mean": sum(rhos) / len(rhos), "relative_error": max(errors)}
