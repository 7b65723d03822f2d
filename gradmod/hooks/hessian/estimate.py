"""``curvature(model, loss_fn, batch, params=...)``: the top Hessian eigenvalues and the trace of
a loss, per group of the parameters some globs select.

The loss is ``loss_fn(model(x), y)`` on the batch given (a mapping of named losses is summed), as
the model trains on it, never through a rule's transforms: the products are gradients the loss
takes of itself (``gradmod.hooks.hessian.products``). Training is left as it was: no ``.grad``
is written, the random streams (host and the model's devices) are forked and restored, every
module's mode and every buffer (BatchNorm's running statistics) are put back. ``mode="eval"``
(the default, as PyHessian) takes the loss without dropout and with BatchNorm's running
statistics; ``mode="train"``, with the batch's statistics and a dropout mask drawn once.

Groups: ``per="glob"`` each pattern of ``params`` apart (named by the pattern), ``"layer"`` each
module holding selected parameters, ``"all"`` every selected parameter together. An estimate costs
``hvps`` Hessian-vector products per group (each about a backward through the gradient's graph),
reported with it, plus one forward and one backward that keeps its graph.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping

import torch
from torch import Tensor, nn

from gradmod.hooks.hessian.hutchinson import hutchinson
from gradmod.hooks.hessian.lanczos import lanczos
from gradmod.hooks.hessian.products import HessianProducts
from gradmod.hooks.rules import globs

PER = ("glob", "layer", "all")
MODES = ("eval", "train")


@dataclass
class GroupCurvature:
    """One group's estimate: its parameters, the ``k`` largest eigenvalues (largest first), the
    trace and its standard error (None without probes), the products it cost, the eigenvectors
    (flat, a row each: the next estimate's warm start), and the largest of the eigenvalues'
    residuals over their size (at most ``tol`` where Lanczos converged within ``iterations``)."""

    params: list[str]
    eigenvalues: list[float]
    trace: float | None
    trace_se: float | None
    hvps: int
    vectors: Tensor | None = field(default=None, repr=False)
    residual: float = math.nan


def curvature(
    model: nn.Module,
    loss_fn: Callable[[Any, Any], Any],
    batch: tuple[Any, Any],
    params: str | list[str] = "*",
    *,
    exclude: str | list[str] | None = None,
    per: str = "glob",
    k: int = 1,
    iterations: int = 20,
    probes: int = 0,
    tol: float = 1e-5,
    seed: int = 0,
    mode: str = "eval",
    warm: Mapping[str, GroupCurvature] | None = None,
    rule: str = "curvature",
    forward: Callable[[Any], Any] | None = None,
) -> dict[str, GroupCurvature]:
    """group -> ``GroupCurvature`` of ``loss_fn(model(x), y)`` at ``batch = (x, y)``.

    ``k`` eigenvalues by at most ``iterations`` Lanczos steps each (stopping once their
    residuals are below ``tol`` of their size), the trace from ``probes`` Rademacher probes
    (0: none); the random start and probes come from ``seed``; ``warm``: a previous estimate
    whose eigenvectors start this one; ``rule``: the name messages give (``hooks.<rule>``);
    ``forward``: how the model takes ``x`` (default ``model(x)``; e.g. ``lambda kw: model(**kw)``)."""
    check(per=per, k=k, iterations=iterations, probes=probes, mode=mode, tol=tol, rule=rule)
    groups = select_groups(model, params, exclude, per, rule)
    named = dict(model.named_parameters())
    chosen = {n: named[n] for names in groups.values() for n in names}
    generator = torch.Generator().manual_seed(seed)
    out = {}
    with _untouched(model, mode):
        x, y = batch
        pred = model(x) if forward is None else forward(x)
        products = HessianProducts(_scalar(loss_fn(pred, y)), chosen, groups)
        for group, names in groups.items():
            before = products.count
            matvec = lambda v, g=group: products.hvp(g, v)  # noqa: E731
            start = _start(products, group, (warm or {}).get(group), generator)
            ritz = lanczos(matvec, start, k, iterations, tol)
            trace = hutchinson(matvec, start, probes, generator) if probes else None
            value, se = (None, None) if trace is None else trace
            hvps = products.count - before
            out[group] = GroupCurvature(names, ritz.values, value, se, hvps, ritz.vectors.detach(), max(ritz.residuals))
    return out


def curvature_rule(
    every: int = 100,
    k: int = 1,
    iterations: int = 20,
    probes: int = 0,
    per: str = "glob",
    batch: int | None = None,
    tol: float = 5e-3,
    mode: str = "eval",
    seed: int = 0,
) -> Any:
    """The ``curvature`` transform's entry: its arguments (``gradmod/conf/hooks/curvature.yaml``).
    It transforms no gradient; gradmod's trainer and the Lightning and Transformers callbacks take its
    rule out of the ones they attach and estimate every ``every`` steps (``gradmod.training.curvature``):
    attached as a transform, it is refused."""
    raise ValueError(
        "curvature is not a gradient transform: gradmod's trainer and its Lightning and Transformers callbacks "
        "run a curvature rule every N steps (+hooks=curvature); in your own loop call gradmod.hooks.curvature(model, loss_fn, (x, y), params)"
    )


def check(*, per: str, k: int, iterations: int, probes: int, mode: str, tol: float, rule: str) -> None:
    """The estimate's arguments, each refused in one line naming what is allowed."""
    where = f"hooks.{rule}"
    for name, value, low in (("k", k, 1), ("iterations", iterations, 1), ("probes", probes, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{where}: {name}={value!r} must be an int >= {low}")
    if iterations < k:
        raise ValueError(f"{where}: iterations={iterations} must be >= k={k} (each Lanczos step adds one eigenvalue)")
    if per not in PER:
        raise ValueError(f"{where}: per={per!r}; allowed: {', '.join(PER)}")
    if mode not in MODES:
        raise ValueError(f"{where}: mode={mode!r}; allowed: {', '.join(MODES)}")
    if not isinstance(tol, (int, float)) or isinstance(tol, bool) or not tol > 0:
        raise ValueError(f"{where}: tol={tol!r} must be a number > 0")


def select_groups(
    model: nn.Module, params: str | list[str], exclude: str | list[str] | None, per: str, rule: str = "curvature"
) -> dict[str, list[str]]:
    """group -> parameter names (model order): the trainable parameters the globs select, a
    pattern matching nothing refused in one line (``gradmod.hooks.rules.globs``)."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    kinds = globs.param_kinds(model)
    if per == "glob":
        groups = {
            pattern: globs.select(rule, {"params": pattern, "exclude": exclude}, names, "trainable parameter", kinds)
            for pattern in globs.patterns(f"hooks.{rule}.params", params)
        }
        return groups
    chosen = globs.select(rule, {"params": params, "exclude": exclude}, names, "trainable parameter", kinds)
    if per == "all":
        return {"all": chosen}
    layers: dict[str, list[str]] = {}
    for n in chosen:
        layers.setdefault(n.rpartition(".")[0] or n, []).append(n)
    return layers


def _scalar(loss: Any) -> Tensor:
    if isinstance(loss, Mapping):
        return torch.stack([v.float() for v in loss.values()]).sum()
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        raise ValueError("curvature: loss_fn must return one scalar loss (or a mapping of them)")
    return loss.reshape(())


def _start(products: HessianProducts, group: str, warm: GroupCurvature | None, generator: torch.Generator) -> Tensor:
    """The last estimate's eigenvectors, or else the loss's gradient (it lies mostly in the top
    eigenvectors' span: Gur-Ari et al., 2018; on ResNet-18 past its first steps a cold estimate took
    4 to 5 products from it, 7 to 8 from a random vector), plus a little random noise (any direction
    they miss is still reached); only the noise where both are missing or zero."""
    like = products.like(group)
    # drawn on the host in the vector's own precision (a float64 draw of ResNet-18's 11M took 0.3 s, 5x this)
    dtype = like.dtype if like.dtype in (torch.float32, torch.float64) else torch.float32
    noise = torch.randn(like.numel(), generator=generator, dtype=dtype).to(like.device, like.dtype)
    if warm is not None and warm.vectors is not None and warm.vectors.shape[-1] == like.numel():
        vectors = warm.vectors.to(like.device, like.dtype)
        toward = vectors[0] if len(vectors) == 1 else vectors.sum(0)
    else:
        toward = products.gradient(group)
    size = float(toward.norm())
    if not math.isfinite(size) or size == 0:
        return noise
    # in place: each new vector of ResNet-18's size page-faults afresh (0.15 s of an estimate)
    return noise.mul_(1e-2 / float(noise.norm())).add_(toward, alpha=1 / size)


@contextlib.contextmanager
def _untouched(model: nn.Module, mode: str) -> Iterator[None]:
    """The model in ``mode``, then every module's mode, every buffer and the random streams as they were."""
    flags = [(m, m.training) for m in model.modules()]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    devices = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    with torch.random.fork_rng(devices=devices):
        model.train(mode == "train")
        try:
            yield
        finally:
            for m, flag in flags:
                m.training = flag
            with torch.no_grad():
                for b, kept in buffers:
                    b.copy_(kept)
