"""Which names a rule's patterns select: globs over ``named_parameters()`` or
``named_modules()`` names, selectors (``@last_layer``, ``@embeddings``, ``@norms``,
``@biases``, ``@vectors``, ``@matrices``, ``@no_weight_decay``: parameters by the place they hold in
the model, their shape or the model's own list; ``@shared``: those every task's loss reaches, ``gradmod.hooks.rules.shared``),
and for a pattern that matches nothing, an error listing close names. Hook rules and optimizer groups resolve
their globs here, so a selector means one thing in both."""

from __future__ import annotations

import difflib
import fnmatch
import re
from typing import Any, Iterable, Mapping, NamedTuple

from torch import nn

from gradmod.hooks.rules import shared as shared_params
from gradmod.hooks.rules.shared import SHARED

LAST_LAYER = "@last_layer"  # in params or exclude: the last module's parameters (see _matches)
SELECTORS = {
    LAST_LAYER: "the parameters of the module that holds the last parameter (a classifier, a head)",
    "@embeddings": "the parameters of embedding modules (nn.Embedding, nn.EmbeddingBag)",
    "@norms": "the parameters of normalisation modules (BatchNorm, LayerNorm, GroupNorm, RMSNorm, ...)",
    "@biases": "every parameter named bias",
    "@vectors": "every parameter of 0 or 1 dimensions (biases, norms' scales, layer-scale gammas)",
    "@matrices": "weights of 2 or more dimensions outside the embeddings and the last layer",
    "@no_weight_decay": "the names (globs) the model's own no_weight_decay() gives (timm's models: pos_embed, cls_token)",
    SHARED: "the parameters every task's loss reaches (a multi-task model's trunk)",
}
INPUT = "@input"  # in a modules rule: the model itself, whose input a penalty differentiates
MODULE_SELECTORS = {INPUT: "the model itself (its input's gradient: input_grad_penalty)"}
EMBEDDINGS = (nn.Embedding, nn.EmbeddingBag)
NORMS = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.LocalResponseNorm)
NORM_NAME = re.compile(r"Norm(\dd)?$")  # a library's own norm class: LlamaRMSNorm, T5LayerNorm, LayerNorm2d


class ParamKind(NamedTuple):
    """What a selector needs to know of one parameter, read once from the model."""

    module: str  # the type of the module that holds it: "embedding" | "norm" | "other"
    ndim: int
    no_weight_decay: bool = False  # matched by the model's own no_weight_decay() (timm's convention)
    transposed: bool = False  # a weight stored (in, out): Hugging Face's Conv1D (GPT-2's c_attn, c_fc)


def param_kinds(model: nn.Module) -> dict[str, ParamKind]:
    """Parameter name -> its ``ParamKind``, for every name ``model.named_parameters()`` may give
    (a tied parameter under each of its names)."""
    kinds = {}
    own = own_no_weight_decay(model)
    for prefix, module in model.named_modules(remove_duplicate=False):
        kind = _module_kind(module)
        for name, p in module.named_parameters(recurse=False):
            full = f"{prefix}.{name}" if prefix else name
            flipped = name == "weight" and type(module).__name__ == "Conv1D" and p.ndim == 2
            kinds[full] = ParamKind(kind, p.ndim, any(fnmatch.fnmatchcase(full, g) for g in own), flipped)
    return kinds


def own_no_weight_decay(model: nn.Module) -> list[str]:
    """The globs ``model.no_weight_decay()`` gives (timm's models, BEiT's, DeiT's), [] where it has none;
    timm matches them with fnmatch, as here."""
    method = getattr(model, "no_weight_decay", None)
    if not callable(method):
        return []
    return [str(g) for g in method() or ()]


def _module_kind(module: nn.Module) -> str:
    if isinstance(module, EMBEDDINGS):
        return "embedding"
    if isinstance(module, NORMS) or NORM_NAME.search(type(module).__name__):
        return "norm"
    return "other"


def patterns(where: str, value: Any) -> list[str]:
    """A glob or a non-empty list of globs, as a list (else one line naming ``where``)."""
    if isinstance(value, str):
        value = [value]
    if (
        not isinstance(value, Iterable)
        or isinstance(value, Mapping)
        or not value
        or not all(isinstance(v, str) and v for v in value)
    ):
        raise ValueError(f"{where}: {shown(value)} must be a glob or a non-empty list of globs")
    return list(value)


def shown(value: Any, limit: int = 80) -> str:
    """``repr(value)`` for a message, a long one cut (a 5,000-character glob is not echoed whole)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 20]}... ({len(text):,} characters)"


def name_hint(pattern: str, names: list[str]) -> str:
    """What to say after a name or glob matched nothing: the close names, else a few real ones."""
    close = difflib.get_close_matches(pattern[:200], names, n=5, cutoff=0.4)  # a longer one is close to none
    return f"close names: {', '.join(close)}" if close else f"names look like: {', '.join(names[:5])}"


def _no_match(where: str, pattern: str, names: list[str], what: str) -> ValueError:
    hint = "the model has none of them" if pattern in SELECTORS else name_hint(pattern, names)
    if pattern == "@no_weight_decay":
        hint = "the model has no no_weight_decay() method, or its names match none of its parameters"
    return ValueError(f"{where}: {shown(pattern)} matches no {what}; {hint}")


def last_layer(names: list[str]) -> list[str]:
    """The parameters of the module that holds the last of ``names`` (in
    ``model.named_parameters()`` order: a classifier, on the models that register it last:
    torchvision's and timm's)."""
    owner = names[-1].rpartition(".")[0] if names else None
    return [n for n in names if n.rpartition(".")[0] == owner]


def _matches(
    where: str,
    pattern: str,
    names: list[str],
    what: str,
    kinds: Mapping[str, ParamKind] | None = None,
    shared: list[str] | None = None,
) -> list[str]:
    """The names ``pattern`` matches: a glob, or a selector (``SELECTORS``), which needs
    ``kinds`` (``param_kinds(model)``) but for ``@last_layer`` and ``@shared`` (``shared``:
    what ``shared_params.find`` found, None where it has not run)."""
    if not pattern.startswith("@"):
        return fnmatch.filter([n for n in names if n], pattern)  # "" (the model itself) only as @input
    if pattern in MODULE_SELECTORS and not what.startswith("parameter"):
        return [n for n in names if n == ""]
    if pattern in MODULE_SELECTORS:
        raise ValueError(f"{where}: {pattern} is {MODULE_SELECTORS[pattern]}, for a modules rule")
    if pattern not in SELECTORS:
        allowed = SELECTORS if what.startswith("parameter") else MODULE_SELECTORS
        raise ValueError(f"{where}: {pattern!r} is not a selector; allowed: {', '.join(allowed)}")
    if not what.startswith("parameter"):
        raise ValueError(
            f"{where}: {pattern} selects parameters; a modules rule names its modules by their globs or {INPUT}"
        )
    if pattern == LAST_LAYER:
        return last_layer(names)
    if pattern == SHARED:
        return shared_params.matches(where, shared, names)
    if kinds is None:
        raise ValueError(f"{where}: {pattern} needs the model's module types; pass kinds=param_kinds(model)")
    if pattern == "@biases":
        return [n for n in names if n.rpartition(".")[2] == "bias"]
    if pattern == "@vectors":
        return [n for n in names if n in kinds and kinds[n].ndim <= 1]
    if pattern == "@no_weight_decay":
        return [n for n in names if n in kinds and kinds[n].no_weight_decay]
    module = {"@embeddings": "embedding", "@norms": "norm"}.get(pattern)
    if module is not None:
        return [n for n in names if n in kinds and kinds[n].module == module]
    head = set(last_layer(names))  # @matrices
    return [n for n in names if n in kinds and kinds[n].ndim >= 2 and kinds[n].module != "embedding" and n not in head]


def matching(
    where: str,
    value: Any,
    names: list[str],
    what: str,
    kinds: Mapping[str, ParamKind] | None = None,
    shared: list[str] | None = None,
) -> set[str]:
    """The names a glob or list of globs (``value``, at config key ``where``) matches; a
    pattern matching nothing is an error naming ``where``."""
    chosen: set[str] = set()
    for pattern in patterns(where, value):
        hits = _matches(where, pattern, names, what, kinds, shared)
        if not hits and pattern == SHARED:
            raise ValueError(
                f"{where}: {SHARED} matches no {what}: no trainable parameter is reached by every task's loss"
            )
        if not hits:
            raise _no_match(where, pattern, names, what)
        chosen.update(hits)
    return chosen


def select(
    rule: str,
    spec: Mapping[str, Any],
    names: list[str],
    what: str,
    kinds: Mapping[str, ParamKind] | None = None,
    prefix: str = "hooks",
    shared: list[str] | None = None,
) -> list[str]:
    """The names a rule selects, in model order; a pattern matching nothing is an error.
    ``kinds``: ``param_kinds(model)``, for the selectors but ``@last_layer``; ``prefix``:
    where the rule lives, for messages (``hooks``, ``optimizer.groups``); ``shared``: what
    ``@shared`` stands for."""
    key = "params" if "params" in spec else "modules"
    chosen = matching(f"{prefix}.{rule}.{key}", spec[key], names, what, kinds, shared)
    if spec.get("exclude") is not None:
        chosen -= matching(f"{prefix}.{rule}.exclude", spec["exclude"], names, what, kinds, shared)
    if not chosen:
        raise ValueError(f"{prefix}.{rule}: exclude removes every {what} the rule selected")
    return [n for n in names if n in chosen]
