"""The per_loss methods' face: from k task gradients (or k losses) to one update.

A method's base class says what it needs (as torchjd's ``Weighting`` and ``Aggregator``):

* ``GramianWeighting``: weights ``w`` (k) from the task gradients' Gramian ``G = J J^T``;
  the update is ``J^T w``. The stage never forms ``J`` for these (``gramian_weightings``,
  ``nash_mtl``).
* ``Aggregator``: the update from the task gradients themselves (``graddrop``,
  ``trimmed_mean``); a ``MatrixWeighting`` is one whose update is ``J^T w``, its weights
  from ``J`` (``excess_mtl``).
* ``LossWeighting``: weights from the loss values alone; the update is the gradient of
  ``sum_i w_i L_i`` (``loss_weightings``).

Weights are computed on the host in float64 (k is small; the Gramian comes over in one
copy), from a Gramian whose rounding is the task gradients' dtype's (``rounding``: a method
that decides a rank reads it there). Random choices draw from the stage's generator, passed
in as ``gen``.
``gradmod.register(name, factory, kind="per_loss")`` adds a method of one's own:
``factory(**args)`` builds a ``Method`` (``gradmod.Method``), a subclass of one of the three
bases, or of ``Method`` itself with ``kind`` naming its base (``gramian``, the default,
``jacobian`` or ``losses``).
"""

from __future__ import annotations

import abc
import importlib.util
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from gradmod.hooks import registry as R
from gradmod.hooks.validators import MAX_COUNT, count, in_range

BASES: dict[str, type[Method]] = {}  # kind -> its base class, filled below the three bases


class Method(metaclass=abc.ABCMeta):  # noqa: B024  (its three bases hold the abstract methods)
    """Base of every per_loss method; stateless unless ``state_dict`` says otherwise.

    ``kind``: its base's (``gramian``, ``jacobian``, ``losses``). A class that subclasses
    ``Method`` itself names its base with it and is taken as a subclass of that base.
    ``per_task_state``: the method keeps a state per task (by position), so every backward
    must bring the same tasks. ``reads_losses``: a loss weighting whose weights depend on
    the loss values, which the stage then reads to the host each step (one sync on a GPU);
    one whose weights do not (sum, mean, random) gets the losses unread, for their number
    and dtype. ``wants_after_step``: the method learns from the step's batch's losses after
    the optimizer step (``after_step``). ``weighs_rest``: the parameters outside the rule
    take the gradient of ``sum_i w_i L_i`` with the weights ``rest_weights`` gives."""

    kind = "gramian"
    name = "method"
    per_task_state = False
    reads_losses = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        base = BASES.get(cls.kind)
        if base is not None and not issubclass(cls, tuple(BASES.values())):
            base.register(cls)  # ``kind`` names the base of a class on Method itself

    @property
    def wants_after_step(self) -> bool:
        return False

    @property
    def weighs_rest(self) -> bool:
        return False

    def set_tasks(self, names: list[str]) -> None:  # noqa: B027  (most methods read no names)
        """The losses' names, in the order of the weights asked next; called before the first
        backward and whenever they change (a method that weights tasks by name reads them)."""

    def end_epoch(self) -> None:  # noqa: B027  (only epoch-based methods act)
        """Called by ``HookSet.end_epoch()``; only epoch-based methods (dwa) act on it."""

    def after_step(self, losses: Tensor) -> None:  # noqa: B027  (famo's same-batch update)
        """The step's batch's losses after the optimizer step (on the host), where
        ``wants_after_step``."""

    def rest_weights(self) -> Tensor | None:
        """Where ``weighs_rest``: the weights of the losses for the parameters outside the
        rule; None: the plain sum."""
        return None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:  # noqa: B027  (stateless by default)
        pass


class GramianWeighting(Method):
    """Weights from the task gradients' Gramian: the update is ``sum_i w_i g_i``."""

    kind = "gramian"

    @abc.abstractmethod
    def weights(self, G: Tensor, gen: torch.Generator) -> Tensor:
        """The k weights from the k x k Gramian (float64, on the host; its rounding is
        ``rounding.precision(G)``)."""


class Aggregator(Method):
    """The update from the task gradients themselves."""

    kind = "jacobian"

    @abc.abstractmethod
    def aggregate(self, J: Tensor, U: Tensor) -> Tensor:
        """The update from the ``[k, D]`` task gradients ``J`` and ``D`` uniform draws ``U``."""


class LossWeighting(Method):
    """Weights from the loss values alone: the update is the gradient of ``sum_i w_i L_i``."""

    kind = "losses"

    @abc.abstractmethod
    def loss_weights(self, losses: Tensor, gen: torch.Generator) -> Tensor | list[float]:
        """The k weights (a tensor, or host floats: a torch op costs more than k floats)."""


class MatrixWeighting(Aggregator):
    """An aggregator whose update is ``w^T J``, its weights ``w`` (k) read from the task
    gradients themselves, not only from their Gramian (excess_mtl's per-coordinate state);
    the stage hands it ``J`` without GradScaler's factor and records its weights."""

    @abc.abstractmethod
    def matrix_weights(self, J: Tensor) -> Tensor:
        """The k weights from the ``[k, D]`` task gradients (on their device)."""

    def aggregate(self, J: Tensor, U: Tensor) -> Tensor:
        return self.matrix_weights(J).to(J.dtype) @ J


BASES.update((base.kind, base) for base in (GramianWeighting, Aggregator, LossWeighting))


def check_method(name: str, made: Any) -> None:
    """A per_loss method: a ``Method`` of one of the three bases which defines what its base
    asks for (``weights``, ``aggregate`` or ``loss_weights``); a class is checked when
    registered, what a function builds when a rule is attached."""
    cls = made if isinstance(made, type) else type(made)
    what = f"per_loss method {name!r}"
    if not issubclass(cls, Method):
        raise TypeError(
            f"{what}: its factory builds a {cls.__name__}, not a Method; subclass gradmod's per_loss "
            "Method and define weights (kind 'gramian'), aggregate ('jacobian') or loss_weights ('losses')"
        )
    base = BASES.get(cls.kind)
    if base is None:
        raise TypeError(f"{what}: kind={cls.kind!r}; allowed: {', '.join(BASES)}")
    if not issubclass(cls, base):
        raise TypeError(f"{what}: kind={cls.kind!r} names another base than {cls.__name__}'s; leave kind out")
    (need,) = base.__abstractmethods__
    impl = getattr(cls, need, None)
    if impl is None or getattr(impl, "__isabstractmethod__", False):
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


def _count(name: str, arg: str, value: Any, low: int = 1, high: float = MAX_COUNT) -> int:
    """A method's whole-number argument (``gradmod.hooks.validators.count``): an iteration count
    a step runs through is at most ``MAX_COUNT``; a number of tasks or of steps (``high=inf``)
    is not bounded so."""
    return count(f"per_loss method {name!r}", arg, value, low, high)


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
