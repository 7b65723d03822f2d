"""Which names a rule's patterns select: globs over ``named_parameters()`` or
``named_modules()`` names, ``@last_layer`` (the parameters of the module that holds the last
of them), ``@shared`` (those every task's loss reaches), and for a pattern that matches
nothing, an error listing close names."""

from __future__ import annotations

import difflib
import fnmatch
from typing import Any, Iterable, Mapping

from gradmod.hooks import shared_params
from gradmod.hooks.shared_params import SHARED

LAST_LAYER = "@last_layer"  # in params or exclude: the last module's parameters (see _matches)


def _patterns(rule: str, key: str, value: Any) -> list[str]:
    if isinstance(value, str):
        value = [value]
    if (
        not isinstance(value, Iterable)
        or isinstance(value, Mapping)
        or not value
        or not all(isinstance(v, str) and v for v in value)
    ):
        raise ValueError(f"hooks.{rule}.{key}: {shown(value)} must be a glob or a non-empty list of globs")
    return list(value)


def shown(value: Any, limit: int = 80) -> str:
    """``repr(value)`` for a message, a long one cut (a 5,000-character glob is not echoed whole)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 20]}... ({len(text):,} characters)"


def name_hint(pattern: str, names: list[str]) -> str:
    """What to say after a name or glob matched nothing: the close names, else a few real ones."""
    close = difflib.get_close_matches(pattern[:200], names, n=5, cutoff=0.4)  # a longer one is close to none
    return f"close names: {', '.join(close)}" if close else f"names look like: {', '.join(names[:5])}"


def _no_match(rule: str, key: str, pattern: str, names: list[str], what: str) -> ValueError:
    return ValueError(f"hooks.{rule}.{key}: {shown(pattern)} matches no {what}; {name_hint(pattern, names)}")


def _matches(rule: str, key: str, pattern: str, names: list[str], what: str, shared: list[str] | None) -> list[str]:
    """The names ``pattern`` matches: a glob, ``SHARED`` (the parameters every task's loss
    reaches, ``shared``: None where no forward found them), or ``LAST_LAYER``: the parameters
    of the module that holds the last of them in ``model.named_parameters()`` order (a
    classifier, on the models that register it last: torchvision's and timm's)."""
    if pattern not in (LAST_LAYER, SHARED):
        return fnmatch.filter(names, pattern)
    if not what.startswith("parameter"):
        raise ValueError(
            f"hooks.{rule}.{key}: {pattern} selects parameters; a modules rule names its modules by their globs"
        )
    if pattern == SHARED:
        return shared_params.matches(f"hooks.{rule}.{key}", shared, names)
    owner = names[-1].rpartition(".")[0] if names else None
    return [n for n in names if n.rpartition(".")[0] == owner]


def select(
    rule: str, spec: Mapping[str, Any], names: list[str], what: str, shared: list[str] | None = None
) -> list[str]:
    """The names a rule selects, in model order; a pattern matching nothing is an error.
    ``shared``: what ``@shared`` stands for (``gradmod.hooks.shared_params``)."""
    key = "params" if "params" in spec else "modules"
    chosen: set[str] = set()
    for pattern in _patterns(rule, key, spec[key]):
        hits = _matches(rule, key, pattern, names, what, shared)
        if not hits and pattern == SHARED:
            raise ValueError(
                f"hooks.{rule}.{key}: {SHARED} matches no {what}: no trainable parameter is reached by every task's loss"
            )
        if not hits:
            raise _no_match(rule, key, pattern, names, what)
        chosen.update(hits)
    if spec.get("exclude") is not None:
        for pattern in _patterns(rule, "exclude", spec["exclude"]):
            hits = _matches(rule, "exclude", pattern, names, what, shared)
            if not hits:
                raise _no_match(rule, "exclude", pattern, names, what)
            chosen.difference_update(hits)
    if not chosen:
        raise ValueError(f"hooks.{rule}: exclude removes every {what} the rule selected")
    return [n for n in names if n in chosen]
