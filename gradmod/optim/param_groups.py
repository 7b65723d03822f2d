"""Optimizer groups by glob: ``optimizer.groups`` entries and ``optimizer.no_decay`` turned into
the optimizers to build and their torch parameter groups; ``optimizer.layer_decay`` splits them by
depth (``gradmod.optim.layer_decay``), an entry's ``trust_ratio`` marks its groups
(``gradmod.optim.trust_ratio``).

An entry is ``{params: glob(s), exclude: glob(s), lr_scale: x, optimizer: {_target_: ...},
trust_ratio: {...}, ARG: value, ...}``: its parameters (globs and selectors of ``gradmod.hooks.rules.globs``, over every
parameter of the model, trainable now or not) form a group of the base optimizer with the
entry's arguments, or, with ``optimizer:``, an optimizer of their own. ``lr_scale`` multiplies
the learning rate the group would otherwise have, so an LR scheduler that multiplies each
group's initial rate (torch's ``LambdaLR``, ``CosineAnnealingLR``, ...; timm's) keeps the ratio. Parameters no entry matches form the default group.

Each group records where it came from (its markers, saved with the optimizer's state):
``no_decay`` (weight decay held at 0), ``entry`` (its index), ``entry_args`` (the arguments its
entry set: a new base value does not replace them) and ``entry_lr_scale`` (its ``lr_scale``;
not a group key ``lr_scale``, which timm's schedulers multiply into the rate they set, a
second time over a rate already scaled). ``set_base_argument``
reads them for a resume that changes the base optimizer's arguments (``gradmod.run.resume``);
``describe`` is the plan the run prints.

``entry_plan`` is everything about an entry but the names it selects, so that a config is
checked before the model exists (``gradmod.optim.spec.check``).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import math
import numbers
from typing import Any, Iterable, Mapping

import torch
from torch import nn

from gradmod.hooks.rules.globs import SELECTORS, ParamKind, matching, patterns, select, shown
from gradmod.optim.combined import CombinedOptimizer
from gradmod.optim.layer_decay import LR_SCALE, by_depth, depths, factor_of
from gradmod.optim.trust_ratio import KEY as TRUST
from gradmod.optim.trust_ratio import settings

ENTRY_KEYS = ("params", "exclude", "lr_scale", "optimizer", "trust_ratio")
WHAT = "parameter (see model.named_parameters())"
AS_ONE = "several optimizers as one step each without one"  # CombinedOptimizer.step


@dataclasses.dataclass
class Part:
    """One optimizer to build: ``cls(groups, **kwargs)``; ``where`` names its config node."""

    cls: type
    kwargs: dict[str, Any]
    groups: list[dict[str, Any]]
    where: str


def locate(path: Any, key: str) -> Any:
    """The object at dotted ``path`` (``package.module.name``: a ``_target_``); ``key`` names
    the config entry in the one line that says it does not import."""
    module, _, name = str(path).rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as e:
        where = (
            "; it is imported from the current folder, PYTHONPATH or an installed package"
            if isinstance(e, ImportError)
            else ""
        )
        raise ValueError(f"{key}={path!r} does not import ({type(e).__name__}: {e}){where}") from None


def optimizer_class(path: Any, key: str, example: str) -> type:
    """The ``torch.optim.Optimizer`` subclass at ``path``; one line naming ``key`` (and an
    ``example`` of what is allowed there) when it does not import or is not one."""
    try:
        cls = locate(path, key)
    except ValueError as e:
        raise ValueError(f"{e}; e.g. {example}") from None
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ValueError(f"{key}={path!r} is not a torch.optim.Optimizer; e.g. {example}")
    return cls


def check_step(cls: type, key: str, stepped: str) -> None:
    """``cls.step()`` works without arguments: an optimizer whose step needs a closure (LBFGS,
    which evaluates the loss itself) is refused where ``stepped`` says it gets none."""
    try:
        params = list(inspect.signature(cls.step).parameters.values())[1:]
    except (TypeError, ValueError):
        return
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    needed = [p.name for p in params if p.kind in kinds and p.default is inspect.Parameter.empty]
    if needed:
        raise ValueError(
            f"{key}: {cls.__name__}.step needs a {needed[0]} (it evaluates the loss itself), and {stepped}; "
            "allowed: an optimizer whose step() takes no argument, e.g. torch.optim.AdamW, torch.optim.SGD"
        )


def _signature_chain(cls: type) -> tuple[list[str], bool]:
    """The keyword arguments ``cls`` names besides ``params``, along its ``**kwargs`` chain up
    the classes, and whether it takes any other: ``**kwargs`` that reach an ``Optimizer(params,
    defaults)`` join its defaults (pytorch-optimizer's classes), so every key is one."""
    names: list[str] = []
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    for klass in cls.__mro__:
        if "__init__" not in vars(klass):
            continue
        params = list(inspect.signature(klass.__init__).parameters.values())[1:]
        named = [p.name for p in params if p.kind in kinds and p.name != "params"]
        if klass is not cls and named == ["defaults"]:  # the optimizers' base: what came down is its defaults
            return names, True
        names += [n for n in named if n not in names]
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
            return names, False
    return names, True


def arguments_of(cls: type) -> list[str] | None:
    """The keyword arguments ``cls`` takes besides ``params``; None: any (``**kwargs`` that
    become its defaults, or reach no signature that lists them)."""
    names, any_other = _signature_chain(cls)
    return None if any_other else names


def default_of(cls: type, name: str) -> Any:
    """The default of ``cls``'s argument ``name`` (None if it has none)."""
    for klass in cls.__mro__:
        if "__init__" in vars(klass):
            p = inspect.signature(klass.__init__).parameters.get(name)
            if p is not None and p.default is not inspect.Parameter.empty:
                return p.default
    return None


def check_arguments(cls: type, args: Iterable[str], where: str, also: tuple[str, ...] = ()) -> None:
    """Every name in ``args`` is an argument ``cls`` takes (or one of ``also``)."""
    allowed = arguments_of(cls)
    if allowed is None:
        return
    for key in args:
        if key not in allowed and key not in also:
            extra = f"; an entry also takes {', '.join(also)}" if also else ""
            raise ValueError(
                f"{where}.{key}: {cls.__qualname__} takes no argument {key!r}; it takes {', '.join(allowed)}{extra}"
            )


@dataclasses.dataclass
class Entry:
    """An ``optimizer.groups`` entry, checked, without its parameters: ``cls`` None for a group
    of the base optimizer, else its own optimizer, built with ``kwargs``; ``options`` are its
    groups' arguments and markers; ``where`` names its config node."""

    cls: type | None
    kwargs: dict[str, Any]
    options: dict[str, Any]
    where: str


def entries_of(entries: Any) -> list[Any]:
    """``optimizer.groups`` as a list; anything else (a mapping: one entry not in a list) is one line."""
    if not isinstance(entries, (list, tuple)):
        raise ValueError(
            f"optimizer.groups: {shown(entries)} must be a list of entries, e.g. [{{params: '@matrices', lr_scale: 0.5}}]"
        )
    return list(entries)


def entry_plan(i: int, entry: Any, base: type, base_kwargs: Mapping[str, Any]) -> Entry:
    """Entry ``i`` checked without the model (its keys, the types of its values, its optimizer)
    and turned into what its groups get; the names it selects are the model's (``plan``)."""
    if not isinstance(entry, Mapping) or entry.get("params") is None:
        raise ValueError(
            f"optimizer.groups.{i}: an entry is a mapping with params (globs or selectors: {', '.join(SELECTORS)}), "
            f"optional exclude, lr_scale, optimizer and the optimizer's arguments; got {shown(entry)}"
        )
    for key in ("params", "exclude"):
        if entry.get(key) is not None:
            _check_patterns(f"optimizer.groups.{i}.{key}", entry[key])
    trust = {} if entry.get(TRUST) is None else {TRUST: settings(f"optimizer.groups.{i}.{TRUST}", entry[TRUST])}
    if entry.get("optimizer") is None:
        options = {**_base_entry_options(i, entry, base, base_kwargs), **trust}
        return Entry(None, {}, options, f"optimizer.groups.{i}")
    cls, kwargs = _own_optimizer(i, entry)
    # every argument of its own optimizer is the entry's: a resume's new base value changes none
    options = {"entry": i, "entry_args": sorted(set(_signature_chain(cls)[0]) | set(kwargs)), **trust}
    if entry.get("lr_scale") is not None:
        kwargs["lr"] = _lr(i, cls, kwargs) * _scale(i, entry["lr_scale"])
        options[LR_SCALE] = float(entry["lr_scale"])
    return Entry(cls, kwargs, options, f"optimizer.groups.{i}.optimizer")


def plan(
    named: Iterable[tuple[str, nn.Parameter]],
    kinds: Mapping[str, ParamKind],
    base: type,
    base_kwargs: Mapping[str, Any],
    *,
    no_decay: Any = (),
    entries: Any = (),
    layer_decay: Any = None,
) -> list[Part]:
    """The optimizers to build: the base one (the default group, then the groups of entries
    without an optimizer of their own), then one per entry with its own; each group split in
    two where ``no_decay`` matches some of its parameters, and by depth with ``layer_decay``
    (``gradmod.optim.layer_decay``). Lists from a config become the tuples
    torch expects (``betas``), here for every optimizer."""
    params = dict(named)
    names = list(params)
    base_kwargs = {k: _plain(v) for k, v in base_kwargs.items()}
    entries = entries_of(entries)
    planned = [entry_plan(i, e, base, base_kwargs) for i, e in enumerate(entries)]
    exempt = matching("optimizer.no_decay", list(no_decay), names, "parameter", kinds) if no_decay else set()
    owner: dict[str, int] = {}
    chosen = [_entry_names(i, e, names, kinds, owner) for i, e in enumerate(entries)]
    default = [n for n in names if n not in owner]
    parts = [Part(base, dict(base_kwargs), _split(params, default, {}, exempt), "optimizer")]
    for entry, picked in zip(planned, chosen):
        groups = _split(params, picked, entry.options, exempt)
        if entry.cls is None:
            parts[0].groups += groups
        else:
            parts.append(Part(entry.cls, entry.kwargs, groups, entry.where))
    for part in parts:
        takes = arguments_of(part.cls)
        if takes is not None and "weight_decay" not in takes and any(g.get("no_decay") for g in part.groups):
            raise ValueError(
                f"optimizer.no_decay: {part.where}._target_ ({part.cls.__name__}) has no weight_decay to hold at 0; "
                "leave its parameters out of no_decay"
            )
    for part in parts:  # an optimizer that reads a matrix's shape (Muon) is told which are stored (in, out)
        if getattr(part.cls, "reads_transposed", False):
            part.groups = [g for group in part.groups for g in _by_layout(group, params, kinds)]
    factor = factor_of(layer_decay)
    if factor is not None:
        depth, name = depths(layer_decay, names, kinds), {id(p): n for n, p in params.items()}
        for part in parts:
            part.groups = [
                g for group in part.groups for g in by_depth(group, _group_lr(part, group), depth, factor, name)
            ]
    return [p for p in parts if p.groups]


def _by_layout(
    group: dict[str, Any], params: Mapping[str, nn.Parameter], kinds: Mapping[str, ParamKind]
) -> list[dict[str, Any]]:
    """``group`` split in two where some of its weights are stored transposed (marked ``transposed``)."""
    flipped = {id(p) for n, p in params.items() if n in kinds and kinds[n].transposed}
    groups = [
        {**group, "params": [p for p in group["params"] if id(p) not in flipped]},
        {**group, "params": [p for p in group["params"] if id(p) in flipped], "transposed": True},
    ]
    return [g for g in groups if g["params"]]


def _group_lr(part: Part, group: Mapping[str, Any]) -> float:
    lr = group.get("lr", part.kwargs.get("lr", default_of(part.cls, "lr")))
    if not isinstance(lr, (int, float)):
        raise ValueError(f"optimizer.layer_decay: {part.where} ({part.cls.__name__}) has no learning rate to decay")
    return float(lr)


def _entry_names(
    i: int, entry: Mapping[str, Any], names: list[str], kinds: Mapping[str, ParamKind], owner: dict[str, int]
) -> list[str]:
    """The names entry ``i`` selects; a name an earlier entry holds is an error."""
    picked = select(str(i), entry, names, WHAT, kinds, prefix="optimizer.groups")
    for n in picked:
        if n in owner:
            raise ValueError(
                f"optimizer.groups.{i}.params: {n} is matched by optimizer.groups.{owner[n]} too; a parameter "
                "belongs to one entry: narrow one of them (exclude)"
            )
        owner[n] = i
    return picked


def _check_patterns(where: str, value: Any) -> None:
    """A glob, a selector or a non-empty list of them (what they match is the model's)."""
    for pattern in patterns(where, value):
        if pattern.startswith("@") and pattern not in SELECTORS:
            raise ValueError(f"{where}: {pattern!r} is not a selector; allowed: {', '.join(SELECTORS)}")


def _base_entry_options(i: int, entry: Mapping[str, Any], base: type, base_kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """A group of the base optimizer: the entry's arguments (checked against the base class), its lr scaled."""
    args = {k: v for k, v in entry.items() if k not in ENTRY_KEYS}
    check_arguments(base, args, f"optimizer.groups.{i}", ENTRY_KEYS)
    check_values(base, args, f"optimizer.groups.{i}")
    options: dict[str, Any] = {**{k: _plain(v) for k, v in args.items()}, "entry": i, "entry_args": sorted(args)}
    if entry.get("lr_scale") is not None:
        if "lr" in args:
            raise ValueError(f"optimizer.groups.{i}: give lr or lr_scale, not both")
        options["lr"] = _lr(i, base, base_kwargs) * _scale(i, entry["lr_scale"])
        options[LR_SCALE] = float(entry["lr_scale"])
    return options


def _own_optimizer(i: int, entry: Mapping[str, Any]) -> tuple[type, dict[str, Any]]:
    """Entry ``i``'s ``optimizer: {_target_: ..., ARG: ...}``, with the entry's own arguments beside it."""
    spec, where = entry["optimizer"], f"optimizer.groups.{i}.optimizer"
    if not isinstance(spec, Mapping) or not spec.get("_target_"):
        raise ValueError(
            f"{where}: {shown(spec)} must be a mapping with a _target_, e.g. {{_target_: torch.optim.Muon}}"
        )
    cls = optimizer_class(spec["_target_"], f"{where}._target_", "torch.optim.SGD, gradmod.optim.Muon")
    check_step(cls, f"{where}._target_", AS_ONE)
    kwargs = {k: v for k, v in spec.items() if k not in ("_target_", "_partial_", "args")}
    kwargs.update(spec.get("args") or {})
    check_arguments(cls, kwargs, where)
    check_values(cls, kwargs, where)
    beside = {k: v for k, v in entry.items() if k not in ENTRY_KEYS}
    check_arguments(cls, beside, f"optimizer.groups.{i}", ENTRY_KEYS)
    check_values(cls, beside, f"optimizer.groups.{i}")
    both = sorted(set(beside) & set(kwargs))
    if both:
        raise ValueError(f"optimizer.groups.{i}: {both[0]} is given beside optimizer: and in it; give it once")
    if "lr" in {**kwargs, **beside} and entry.get("lr_scale") is not None:
        raise ValueError(f"optimizer.groups.{i}: give lr or lr_scale, not both")
    return cls, {k: _plain(v) for k, v in {**kwargs, **beside}.items()}


def check_values(cls: type, args: Mapping[str, Any], where: str) -> None:
    """An argument whose default in ``cls`` is a number gets a number (or null, or a tensor),
    and ``lr`` a finite one >= 0: not text that would reach the constructor's comparisons."""
    for key, value in args.items():
        if value is None or isinstance(value, torch.Tensor):
            continue
        number = isinstance(value, numbers.Real) and not isinstance(value, bool)
        if key == "lr" and not (number and math.isfinite(value) and value >= 0):
            raise ValueError(f"{where}.lr: {shown(value)} must be a finite number >= 0 (a learning rate)")
        default = default_of(cls, key)
        if isinstance(default, numbers.Real) and not isinstance(default, bool) and not number:
            raise ValueError(f"{where}.{key}: {shown(value)} must be a number ({cls.__name__}'s default: {default!r})")


def _lr(i: int, cls: type, kwargs: Mapping[str, Any]) -> float:
    lr = kwargs.get("lr", default_of(cls, "lr"))
    if not isinstance(lr, (int, float)):
        raise ValueError(f"optimizer.groups.{i}.lr_scale: {cls.__name__} has no learning rate to scale; give lr")
    return float(lr)


def _scale(i: int, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"optimizer.groups.{i}.lr_scale: {shown(value)} must be a finite number >= 0")
    return float(value)


def _plain(value: Any) -> Any:
    """A list from the config as the tuple torch expects (``betas``)."""
    return tuple(value) if isinstance(value, list) else value


def _split(
    params: Mapping[str, nn.Parameter], names: list[str], options: dict[str, Any], exempt: set[str]
) -> list[dict[str, Any]]:
    """One group of ``names`` with ``options``, and one more of those in ``exempt`` (weight decay 0)."""
    groups = [
        {"params": [params[n] for n in names if n not in exempt], **options},
        {"params": [params[n] for n in names if n in exempt], **options, "weight_decay": 0.0, "no_decay": True},
    ]
    return [g for g in groups if g["params"]]


def set_base_argument(optimizer: torch.optim.Optimizer, name: str, value: Any) -> None:
    """A new value of the base optimizer's argument ``name`` (a resume's ``optimizer.NAME``),
    written into the groups that take it from the base, as their markers say: ``weight_decay``
    stays 0 in a ``no_decay`` group, an argument its entry set (every one, for an entry's own
    optimizer) stays, and ``lr`` is multiplied by the group's ``entry_lr_scale``."""
    for group in optimizer.param_groups:
        if (name == "weight_decay" and group.get("no_decay")) or name in group.get("entry_args", ()):
            continue
        if name in group:
            new = value * group[LR_SCALE] if name == "lr" and LR_SCALE in group else value
            group[name] = tuple(new) if isinstance(group[name], tuple) else new


def describe(model: nn.Module, optimizer: torch.optim.Optimizer, entries: bool) -> str:
    """The optimizer's parameter groups by name, as ``optimizer.no_decay`` (and
    ``optimizer.groups`` or ``optimizer.layer_decay``: each group's optimizer, learning rate and depth too) made them."""
    names = {id(p): n for n, p in model.named_parameters()}
    held = optimizer.optimizers if isinstance(optimizer, CombinedOptimizer) else [optimizer]
    parts = []
    for o in held:
        for g in o.param_groups:
            listed = [names[id(p)] for p in g["params"]]
            listing = ", ".join(listed[:6]) + (f", ... ({len(listed)} in all)" if len(listed) > 6 else "")
            what = f"{type(o).__name__} lr={g['lr']:g} " if entries or "depth" in g else ""
            where = f"depth {g['depth']} " if "depth" in g else ""
            parts.append(f"{where}{what}weight_decay={g.get('weight_decay', 0.0):g}: {listing}")
    made = "groups" if entries else "layer_decay" if any("depth" in g for g in optimizer.param_groups) else "no_decay"
    return f"optimizer groups (optimizer.{made}): " + "; ".join(parts)
