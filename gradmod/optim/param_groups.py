"""Optimizer groups by glob: ``optimizer.groups`` entries and ``optimizer.no_decay`` turned into
the optimizers to build and their torch parameter groups.

An entry is ``{params: glob(s), exclude: glob(s), lr_scale: x, optimizer: {_target_: ...},
ARG: value, ...}``: its parameters (globs and selectors of ``gradmod.hooks.rules.globs``, over every
parameter of the model, trainable now or not) form a group of the base optimizer with the
entry's arguments, or, with ``optimizer:``, an optimizer of their own. ``lr_scale`` multiplies
the learning rate the group would otherwise have, so an LR scheduler, which multiplies each
group's initial rate, keeps the ratio. Parameters no entry matches form the default group.

Each group records where it came from, for a resume that changes the base optimizer's
arguments (``gradmod.run.resume``): ``no_decay`` (weight decay held at 0), ``entry`` (its
index), ``entry_args`` (the arguments its entry set: a new base value does not replace them)
and ``lr_scale``.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import math
from typing import Any, Iterable, Mapping

from torch import nn

from gradmod.hooks.rules.globs import SELECTORS, ParamKind, matching, select, shown

ENTRY_KEYS = ("params", "exclude", "lr_scale", "optimizer")
WHAT = "parameter (see model.named_parameters())"
MARKERS = ("no_decay", "entry", "entry_args", "lr_scale")  # a group's record of where it came from


@dataclasses.dataclass
class Part:
    """One optimizer to build: ``cls(groups, **kwargs)``; ``where`` names its config node."""

    cls: type
    kwargs: dict[str, Any]
    groups: list[dict[str, Any]]
    where: str


def locate(path: Any, where: str) -> type:
    """The class at dotted ``path``; one line naming ``where`` when it does not import or is not an optimizer."""
    import torch

    module, _, name = str(path).rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"{where}._target_={path!r} does not import ({type(e).__name__}: {e})") from None
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ValueError(f"{where}._target_={path!r} is not a torch.optim.Optimizer")
    return cls


def arguments_of(cls: type) -> list[str] | None:
    """The keyword arguments ``cls`` takes besides ``params``; None: any (``**kwargs`` to the end)."""
    for klass in cls.__mro__:
        if "__init__" not in vars(klass):
            continue
        params = list(inspect.signature(klass.__init__).parameters.values())[1:]
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
            kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
            return [p.name for p in params if p.kind in kinds and p.name != "params"]
    return None


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


def plan(
    named: Iterable[tuple[str, nn.Parameter]],
    kinds: Mapping[str, ParamKind],
    base: type,
    base_kwargs: Mapping[str, Any],
    *,
    no_decay: Any = (),
    entries: Any = (),
) -> list[Part]:
    """The optimizers to build: the base one (the default group, then the groups of entries
    without an optimizer of their own), then one per entry with its own; each group split in
    two where ``no_decay`` matches some of its parameters. Lists from a config become the tuples
    torch expects (``betas``), here for every optimizer."""
    params = dict(named)
    names = list(params)
    base_kwargs = {k: _plain(v) for k, v in base_kwargs.items()}
    if not isinstance(entries, (list, tuple)):
        raise ValueError(f"optimizer.groups: {shown(entries)} must be a list of entries")
    exempt = matching("optimizer.no_decay", list(no_decay), names, "parameter", kinds) if no_decay else set()
    owner: dict[str, int] = {}
    chosen = [_entry_names(i, e, names, kinds, owner) for i, e in enumerate(entries)]
    default = [n for n in names if n not in owner]
    parts = [Part(base, dict(base_kwargs), _split(params, default, {}, exempt), "optimizer")]
    for i, (entry, picked) in enumerate(zip(entries, chosen)):
        if entry.get("optimizer") is None:
            options = _base_entry_options(i, entry, base, base_kwargs)
            parts[0].groups += _split(params, picked, options, exempt)
        else:
            cls, kwargs = _own_optimizer(i, entry)
            # every argument of its own optimizer is the entry's: a resume's new base value changes none
            options = {"entry": i, "entry_args": sorted(arguments_of(cls) or kwargs)}
            if entry.get("lr_scale") is not None:
                kwargs["lr"] = _lr(i, cls, kwargs) * _scale(i, entry["lr_scale"])
                options["lr_scale"] = float(entry["lr_scale"])
            parts.append(Part(cls, kwargs, _split(params, picked, options, exempt), f"optimizer.groups.{i}.optimizer"))
    for part in parts:
        takes = arguments_of(part.cls)
        if takes is not None and "weight_decay" not in takes and any(g.get("no_decay") for g in part.groups):
            raise ValueError(
                f"optimizer.no_decay: {part.where}._target_ ({part.cls.__name__}) has no weight_decay to hold at 0; "
                "leave its parameters out of no_decay"
            )
    return [p for p in parts if p.groups]


def _entry_names(
    i: int, entry: Any, names: list[str], kinds: Mapping[str, ParamKind], owner: dict[str, int]
) -> list[str]:
    """The names entry ``i`` selects; a name an earlier entry holds is an error."""
    if not isinstance(entry, Mapping) or entry.get("params") is None:
        raise ValueError(
            f"optimizer.groups.{i}: an entry is a mapping with params (globs or selectors: {', '.join(SELECTORS)}), "
            f"optional exclude, lr_scale, optimizer and the optimizer's arguments; got {shown(entry)}"
        )
    picked = select(str(i), entry, names, WHAT, kinds, prefix="optimizer.groups")
    for n in picked:
        if n in owner:
            raise ValueError(
                f"optimizer.groups.{i}.params: {n} is matched by optimizer.groups.{owner[n]} too; a parameter "
                "belongs to one entry: narrow one of them (exclude)"
            )
        owner[n] = i
    return picked


def _base_entry_options(i: int, entry: Mapping[str, Any], base: type, base_kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """A group of the base optimizer: the entry's arguments (checked against the base class), its lr scaled."""
    args = {k: v for k, v in entry.items() if k not in ENTRY_KEYS}
    check_arguments(base, args, f"optimizer.groups.{i}", ENTRY_KEYS)
    options: dict[str, Any] = {**{k: _plain(v) for k, v in args.items()}, "entry": i, "entry_args": sorted(args)}
    if entry.get("lr_scale") is not None:
        if "lr" in args:
            raise ValueError(f"optimizer.groups.{i}: give lr or lr_scale, not both")
        options["lr"] = _lr(i, base, base_kwargs) * _scale(i, entry["lr_scale"])
        options["lr_scale"] = float(entry["lr_scale"])
    return options


def _own_optimizer(i: int, entry: Mapping[str, Any]) -> tuple[type, dict[str, Any]]:
    """Entry ``i``'s ``optimizer: {_target_: ..., ARG: ...}``, with the entry's own arguments beside it."""
    spec, where = entry["optimizer"], f"optimizer.groups.{i}.optimizer"
    if not isinstance(spec, Mapping) or not spec.get("_target_"):
        raise ValueError(
            f"{where}: {shown(spec)} must be a mapping with a _target_, e.g. {{_target_: torch.optim.Muon}}"
        )
    cls = locate(spec["_target_"], where)
    kwargs = {k: v for k, v in spec.items() if k not in ("_target_", "_partial_", "args")}
    kwargs.update(spec.get("args") or {})
    check_arguments(cls, kwargs, where)
    beside = {k: v for k, v in entry.items() if k not in ENTRY_KEYS}
    check_arguments(cls, beside, f"optimizer.groups.{i}", ENTRY_KEYS)
    both = sorted(set(beside) & set(kwargs))
    if both:
        raise ValueError(f"optimizer.groups.{i}: {both[0]} is given beside optimizer: and in it; give it once")
    if "lr" in {**kwargs, **beside} and entry.get("lr_scale") is not None:
        raise ValueError(f"optimizer.groups.{i}: give lr or lr_scale, not both")
    return cls, {k: _plain(v) for k, v in {**kwargs, **beside}.items()}


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
