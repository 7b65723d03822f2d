"""The per_loss methods: from k task gradients (or k losses) to one update.

Three kinds, by what a method needs:

* ``gramian``: weights ``w`` (k) from the task gradients' Gramian ``G = J J^T``; the
  update is ``J^T w``. The stage never forms ``J`` for these (see ``stage``).
* ``jacobian``: the update from the task gradients themselves (``graddrop``).
* ``losses``: loss weightings that need the loss values only; the update is the gradient
  of ``sum_i w_i L_i`` (``weightings``).

Weights are computed on the host in float64 (k is small; the Gramian comes over in one
copy). Random choices draw from the stage's generator, passed in as ``gen``.
``gradmod.register(name, factory, kind="per_loss")`` adds a method of one's own:
``factory(**args)`` returns an object with ``kind`` and ``weights`` (or ``aggregate``),
like the classes here (``gradmod.Method`` is their base).
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from gradmod.hooks import registry as R
from gradmod.hooks.per_loss import solvers
from gradmod.hooks.validators import in_range

KINDS = ("gramian", "jacobian", "losses")


NEEDS = {"gramian": "weights", "jacobian": "aggregate", "losses": "loss_weights"}  # kind -> what it defines


def check_method(name: str, made: Any) -> None:
    """A per_loss method: a ``Method`` whose ``kind`` is one of ``KINDS`` and which defines
    what its kind needs (``weights``, ``aggregate`` or ``loss_weights``); a class is checked
    when registered, what a function builds when a rule is attached."""
    cls = made if isinstance(made, type) else type(made)
    what = f"per_loss method {name!r}"
    if not issubclass(cls, Method):
        raise TypeError(
            f"{what}: its factory builds a {cls.__name__}, not a Method; subclass gradmod's per_loss "
            "Method and define weights (kind 'gramian'), aggregate ('jacobian') or loss_weights ('losses')"
        )
    need = NEEDS.get(cls.kind)
    if need is None:
        raise TypeError(f"{what}: kind={cls.kind!r}; allowed: {', '.join(KINDS)}")
    impl = getattr(cls, need, None)
    bases = ("Method", "LossWeighting")  # the base classes' stubs, which only raise
    if impl is None or getattr(impl, "__qualname__", "").split(".")[0] in bases:
        raise TypeError(f"{what}: a method of kind {cls.kind!r} defines {need}, and {cls.__name__} does not")


def names() -> list[str]:
    return R.names("per_loss")


def is_method(name: str) -> bool:
    return name in R.names("per_loss")


def build(name: str, args: Mapping[str, Any]) -> Method:
    """The configured method; bad arguments are a ValueError naming the allowed ones."""
    return R.build({"name": name, **args}).fn


def _check(name: str, arg: str, value: Any, low: float, *, strict: bool = False, high: float = math.inf) -> float:
    """A method's numeric argument, checked (``gradmod.hooks.validators.in_range``)."""
    return in_range(f"per_loss method {name!r}", arg, value, low, strict=strict, high=high)


def _per_task(name: str, arg: str, values: Any, low: float, *, high: float = math.inf) -> list[float]:
    """A method's argument of one number per loss (a list in the losses' order), each checked."""
    if isinstance(values, (str, Mapping)) or not isinstance(values, Sequence):
        raise ValueError(
            f"per_loss method {name!r}: {arg}={values!r} must be a list of numbers, one per loss (in the losses' order)"
        )
    return [_check(name, f"{arg}[{i}]", v, low, high=high) for i, v in enumerate(values)]


def _one_per_task(name: str, arg: str, values: list[float] | None, k: int) -> None:
    """Checked in ``set_tasks``, so that the stage names the rule in the message."""
    if values is not None and len(values) != k:
        raise ValueError(f"per_loss method {name!r}: {arg} has {len(values)} values for {k} losses; give one per loss")


def _needs(name: str, modules: list[str], extra: str) -> None:
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise ValueError(f"per_loss method {name!r} needs {', '.join(missing)}, not installed ({extra})")


class Method:
    """Base: stateless unless ``state_dict`` says otherwise. ``per_task_state``: the method
    keeps a state per task (by position), so every backward must bring the same tasks.
    ``reads_losses``: a loss weighting (kind ``losses``) whose weights depend on the loss
    values, which the stage then reads to the host each step (one sync on a GPU); one whose
    weights do not (sum, mean, random) gets the losses unread, for their number and dtype."""

    kind = "gramian"
    name = "method"
    per_task_state = False
    reads_losses = True

    def weights(self, G: Tensor, gen: torch.Generator) -> Tensor:
        raise NotImplementedError

    def set_tasks(self, names: list[str]) -> None:
        """The losses' names, in the order of the weights asked next; called before the first
        backward and whenever they change (a method that weights tasks by name reads them)."""

    def end_epoch(self) -> None:
        """Called by ``HookSet.end_epoch()``; only epoch-based methods (dwa) act on it."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        pass


class Mean(Method):
    """``1/k`` per task. Weights that need no task gradient: the stage runs it as a loss
    weighting (one ordinary backward); ``weights`` gives the same from a Gramian."""

    kind = "losses"
    reads_losses = False
    name = "mean"

    def weights(self, G, gen):
        return torch.full((len(G),), 1.0 / len(G), dtype=G.dtype)

    def loss_weights(self, losses, gen):
        return [1.0 / len(losses)] * len(losses)


class Sum(Method):
    """``1`` per task: the plain sum (``+hooks=mtl_sum``), one ordinary backward."""

    kind = "losses"
    reads_losses = False
    name = "sum"

    def weights(self, G, gen):
        return torch.ones(len(G), dtype=G.dtype)

    def loss_weights(self, losses, gen):
        return [1.0] * len(losses)


class Fixed(Method):
    """Given weights: ``weights`` maps each task's name to its weight, or lists them in the
    losses' order; a loss weighting (one ordinary backward of ``sum_i w_i L_i``)."""

    kind = "losses"
    reads_losses = False
    name = "fixed"

    def __init__(self, weights: Mapping[str, float] | Sequence[float]):
        what = "per_loss method 'fixed': weights"
        if isinstance(weights, Mapping):
            items = [(str(n), v) for n, v in weights.items()]
        elif isinstance(weights, Sequence) and not isinstance(weights, str):
            items = [(str(i), v) for i, v in enumerate(weights)]
        else:
            raise ValueError(
                f"{what}={weights!r}; give a mapping of task name to weight, or a list in the losses' order"
            )
        if not items:
            raise ValueError(f"{what} is empty; give one weight per task")
        checked = {n: _check("fixed", f"weights[{n}]", v, -math.inf) for n, v in items}
        self.by_name: dict[str, float] | None = checked if isinstance(weights, Mapping) else None
        self.listed = list(checked.values())
        self._names: list[str] | None = None

    def set_tasks(self, names: list[str]) -> None:
        if self.by_name is None:
            self._count(len(names))
        else:
            missing = [n for n in names if n not in self.by_name]
            unknown = [n for n in self.by_name if n not in names] if self._names is None else []
            if missing or unknown:
                raise ValueError(
                    f"per_loss method 'fixed': weights name {', '.join(self.by_name)}, the losses are "
                    f"{', '.join(names)}; give one weight per loss, by its name"
                )
        self._names = list(names)

    def loss_weights(self, losses, gen):
        if self.by_name is not None and self._names is not None:
            return [self.by_name[n] for n in self._names]
        self._count(len(losses))
        return self.listed

    def _count(self, k: int) -> None:
        if len(self.listed) != k:
            raise ValueError(
                f"per_loss method 'fixed': {len(self.listed)} weights for {k} losses; give one per loss "
                "(in the losses' order), or a mapping of task name to weight"
            )


class Random(Method):
    """Positive random weights: a softmax of standard normal draws (RLW); a loss weighting."""

    kind = "losses"
    reads_losses = False
    name = "random"

    def weights(self, G, gen):
        return torch.softmax(torch.randn(len(G), generator=gen, dtype=G.dtype), 0)

    def loss_weights(self, losses, gen):
        return torch.softmax(torch.randn(len(losses), generator=gen, dtype=losses.dtype), 0)


class PCGrad(Method):
    """Each task's gradient projected off the others it conflicts with, in random order; summed."""

    name = "pcgrad"

    def weights(self, G, gen):
        g, k = G.numpy(), len(G)
        total = np.zeros(k)
        for i in range(k):
            order = torch.randperm(k, generator=gen).tolist()
            c = np.zeros(k)
            c[i] = 1.0
            for j in order:
                if j == i:
                    continue
                dot = g[j] @ c  # <g_i^PC, g_j>
                if dot < 0.0:
                    c[j] -= dot / g[j, j]
            total = total + c
        return torch.from_numpy(total)


class MGDA(Method):
    """The min-norm point of the convex hull of the task gradients (Frank-Wolfe)."""

    name = "mgda"

    def __init__(self, epsilon: float = 0.001, max_iters: int = 100):
        self.epsilon = _check("mgda", "epsilon", epsilon, 0.0, strict=True)
        self.max_iters = int(_check("mgda", "max_iters", max_iters, 1))

    def weights(self, G, gen):
        g, k = G.numpy(), len(G)
        alpha = np.full(k, 1.0 / k)
        for _ in range(self.max_iters):
            t = int(np.argmin(g @ alpha))
            a, b, c = alpha @ g[:, t], alpha @ (g @ alpha), g[t, t]
            gamma = 1.0 if c <= a else 0.0 if b <= a else (b - a) / (b + c - 2 * a)
            alpha = (1 - gamma) * alpha
            alpha[t] += gamma
            if gamma < self.epsilon:
                break
        return torch.from_numpy(alpha)


class IMTLG(Method):
    """Impartial MTL (gradient part): equal projections of the update on every task's direction."""

    name = "imtl_g"

    def weights(self, G, gen):
        v = torch.linalg.pinv(G) @ torch.sqrt(torch.diagonal(G))
        s = v.sum()
        return torch.zeros_like(v) if s.abs() < 1e-12 else v / s


class AlignedMTL(Method):
    """Aligned-MTL: the task gradients made orthogonal with equal norms (scaled by an eigenvalue)."""

    name = "aligned_mtl"
    SCALES = ("min", "median", "rmse")

    def __init__(self, scale_mode: str = "min"):
        if scale_mode not in self.SCALES:
            raise ValueError(
                f"per_loss method 'aligned_mtl': scale_mode={scale_mode!r}; allowed: {', '.join(self.SCALES)}"
            )
        self.scale_mode = scale_mode

    def weights(self, G, gen):
        k = len(G)
        lam, V = torch.linalg.eigh(G, UPLO="U")
        tol = lam.max() * k * torch.finfo(G.dtype).eps
        rank = int((lam > tol).sum())
        if rank == 0:
            return torch.full((k,), 1.0 / k, dtype=G.dtype)
        order = torch.argsort(lam, descending=True)[:rank]
        lam, V = lam[order], V[:, order]
        scale = {"min": lam[-1], "median": torch.median(lam), "rmse": lam.mean()}[self.scale_mode]
        B = scale.sqrt() * (V / lam.sqrt()) @ V.T
        return B @ torch.full((k,), 1.0 / k, dtype=G.dtype)


class _DualCone(Method):
    """Projections onto the dual cone of the task gradients, as bound-constrained QPs on the
    normalised, regularised Gramian (``solvers.bound_qps``: exact)."""

    def __init__(self, norm_eps: float = 0.0001, reg_eps: float = 0.0001):
        self.norm_eps = _check(self.name, "norm_eps", norm_eps, 0.0)
        self.reg_eps = _check(self.name, "reg_eps", reg_eps, 0.0)

    def _H(self, G: Tensor) -> np.ndarray:
        return solvers.regularize(solvers.normalize(G.numpy(), self.norm_eps), self.reg_eps)


class UPGrad(_DualCone):
    """Each task gradient projected onto the dual cone of all of them; the mean of the projections."""

    name = "upgrad"

    def weights(self, G, gen):
        H, k = self._H(G), len(G)
        w = solvers.bound_qps(H, np.eye(k) / k).sum(0)
        return torch.from_numpy(np.asarray(w, dtype=np.float64)).to(G.dtype)


class DualProj(_DualCone):
    """The mean gradient projected onto the dual cone of the task gradients."""

    name = "dualproj"

    def weights(self, G, gen):
        H, k = self._H(G), len(G)
        return torch.from_numpy(solvers.bound_qp(H, np.full(k, 1.0 / k))).to(G.dtype)


class CAGrad(Method):
    """Conflict-averse gradient: the update in a ball of radius ``c |g_0|`` around the mean that
    maximises the worst task's improvement (a cone program; Clarabel). ``rescale``: 0 leaves
    the update as it is (torchjd, the default); LibMTL's 1 divides it by ``1 + c^2``, 2 by ``1 + c``."""

    name = "cagrad"
    RESCALES = (0, 1, 2)

    def __init__(self, c: float = 0.5, norm_eps: float = 0.0001, rescale: int = 0):
        self.c = _check("cagrad", "c", c, 0.0)
        self.norm_eps = _check("cagrad", "norm_eps", norm_eps, 0.0)
        if rescale not in self.RESCALES or isinstance(rescale, bool):
            raise ValueError(f"per_loss method 'cagrad': rescale={rescale!r}; allowed: 0, 1, 2")
        self.rescale = {0: 1.0, 1: 1.0 + self.c**2, 2: 1.0 + self.c}[rescale]
        _needs("cagrad", ["clarabel", "scipy"], 'pip install clarabel scipy, or "torchjd[cagrad]"')

    def weights(self, G, gen):
        w = torch.from_numpy(solvers.cagrad_socp(G.numpy(), self.c, self.norm_eps)).to(G.dtype)
        return w / self.rescale


class GradVac(Method):
    """Gradient Vaccine: each task's gradient pulled towards a running target cosine with the
    others (random order), from the Gramian; the EMA of the cosines is its state."""

    name = "gradvac"
    per_task_state = True

    def __init__(self, beta: float = 0.5, eps: float = 1e-8):
        self.beta = _check("gradvac", "beta", beta, 0.0, high=1.0)
        self.eps = _check("gradvac", "eps", eps, 0.0)
        self.phi: np.ndarray | None = None  # [k, k] target cosines (EMA)

    def weights(self, G, gen):
        k = len(G)
        if self.phi is None or self.phi.shape != (k, k):
            self.phi = np.zeros((k, k))
        g, phi, beta, eps = G.numpy(), self.phi, self.beta, self.eps
        C = np.eye(k)  # row i: g_i^PC in terms of the original gradients
        for i in range(k):
            cG = C[i] @ g
            others = [j for j in range(k) if j != i]
            for idx in torch.randperm(k - 1, generator=gen).tolist():
                j = others[idx]
                norm_i = math.sqrt(max((cG * C[i]).sum(), 0.0))
                norm_j = math.sqrt(max(g[j, j], 0.0))
                cos = cG[j] / (norm_i * norm_j + eps)
                target = phi[i, j]
                if cos < target:
                    s_cos = math.sqrt(max(1.0 - cos * cos, 0.0))
                    s_tgt = math.sqrt(max(1.0 - target * target, 0.0))
                    step = norm_i * (target * s_cos - cos * s_tgt) / (norm_j * s_tgt + eps)
                    C[i, j] = C[i, j] + step
                    cG = cG + step * g[j]
                phi[i, j] = (1.0 - beta) * target + beta * cos
        return torch.from_numpy(C.sum(0))

    def state_dict(self):
        return {"phi": None if self.phi is None else torch.from_numpy(self.phi.copy())}

    def load_state_dict(self, state):
        self.phi = None if state["phi"] is None else state["phi"].numpy().copy()


class GradDrop(Method):
    """Gradient sign dropout: per coordinate, keep the positive or the negative parts of the
    task gradients, chosen at random by their sign purity. Needs the task gradients. On a
    ``modules:`` rule with ``rows: batch``, the authors' and LibMTL's form (``aggregate_batch``)."""

    kind = "jacobian"
    name = "graddrop"

    def __init__(self, leak: list[float] | None = None):
        self.leak = None if leak is None else _per_task("graddrop", "leak", leak, 0.0, high=1.0)

    def set_tasks(self, names: list[str]) -> None:
        _one_per_task("graddrop", "leak", self.leak, len(names))

    def aggregate(self, J: Tensor, U: Tensor) -> Tensor:
        """``J``: [k, D] task gradients; ``U``: [D] uniform draws."""
        return self._drop(J, J, U, eps=0.0)

    def aggregate_batch(self, D: Tensor, signs: Tensor, U: Tensor) -> Tensor:
        """``D``: [k, B, F] the task gradients of a representation, ``signs``: [B, F] its
        signs, ``U``: [F] uniform draws. Each feature's purity from the tasks' gradients
        times the activation's sign, summed over the batch, and one choice per feature for
        every example (as the paper and LibMTL, whose 1e-7 guards the division)."""
        return self._drop(D, (D * signs).sum(1).unsqueeze(1), U, eps=1e-7)

    def _drop(self, J: Tensor, S: Tensor, U: Tensor, eps: float) -> Tensor:
        """Keep each task's part of ``J`` whose sign in ``S`` (its signed gradients, or their
        batch sums) the draw picks."""
        leak = J.new_zeros(len(J)) if self.leak is None else J.new_tensor(self.leak)
        P = 0.5 * (1.0 + S.sum(0) / (S.abs().sum(0) + eps))
        out = torch.zeros_like(J[0])
        for i in range(len(J)):
            keep = (P > U) * (S[i] > 0) + (P < U) * (S[i] < 0)
            out += (leak[i] + (1 - leak[i]) * keep) * J[i]
        return out
