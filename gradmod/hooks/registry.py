"""The one registry of transforms: name -> entry (factory, kind, optional forms).

A config entry ``{name: clamp, min: -0.01, max: 0.01}`` becomes
``entry("clamp").factory(min=-0.01, max=0.01)``. The entry's *kind* says what the factory
builds and so at which stage it may run (``gradmod.hooks.stages``):

* ``elementwise``: ``grad -> Tensor | None`` on one tensor, never modifying ``grad`` in
  place (``None`` leaves it as it is); stage ``hook`` or ``fused``, the rule's choice. An
  optional ``foreach`` factory builds an in-place form over a list of ``.grad`` tensors,
  used by the fused stage (without one it calls the function per tensor).
* ``group``: one object per rule acting on all its gradients together, a subclass of
  ``gradmod.hooks.group.GroupTransform`` (``apply_(params, grads)`` in place); implies
  stage ``fused``.
* ``per_sample``: read by the per_sample stage on each example's gradient (as
  ``per_sample_clip``); implies stage ``per_sample``.
* ``per_loss``: read by the per_loss stage on each loss's gradient; implies ``per_loss``.
* ``sharpness``: how the sharpness stage perturbs a rule's parameters before its second
  forward and backward (``sam``, ``asam``: ``gradmod.hooks.sharpness``); implies ``sharpness``.

An entry may also have a form at another stage (``add_stage_form``): ``log`` is
element-wise, and at the per_sample stage keeps per-example statistics instead.

The shipped transforms are registered by ``gradmod.hooks.catalog``, which the first read of
the table loads (``entries``); one's own go through ``gradmod.register``.
"""

from __future__ import annotations

import importlib
import inspect
import warnings
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, Callable, Mapping

from gradmod.hooks import stages
from gradmod.hooks.rule_spec import parse_spec
from gradmod.hooks.schedules import with_values

KINDS = ("elementwise", "group", "per_sample", "per_loss", "sharpness")

# How a transform of one's own gets a name (train.py imports the modules named in plugins).
OWN_TRANSFORMS = "a transform of your own is registered with gradmod.register, in a module given as plugins=[my_pkg.x]"


@dataclass(frozen=True)
class Entry:
    """A registered transform: what builds it and what kind it is."""

    name: str
    factory: Callable[..., Any]
    kind: str = "elementwise"
    foreach: Callable[..., Any] | None = None  # elementwise: in-place form over a list of gradients
    observer: bool = False  # keeps statistics and returns None (``log``: a GradStats accumulator)
    at_stage: Mapping[str, Callable[..., Any]] = field(default_factory=dict)  # stage -> factory there

    @property
    def stage(self) -> str | None:
        """The stage this kind forces on a rule; None: the rule chooses (element-wise)."""
        implied = stages.implied_by(self.kind)
        return None if implied is None else implied.name


_ENTRIES: dict[str, Entry] = {}
_catalog_loaded = False


def entries() -> dict[str, Entry]:
    """The table, the shipped transforms in it: the first read loads ``gradmod.hooks.catalog``
    (by name: the catalog imports this module to register, so this one cannot import it)."""
    global _catalog_loaded
    if not _catalog_loaded:
        _catalog_loaded = True
        try:
            importlib.import_module("gradmod.hooks.catalog")
        except BaseException:
            _catalog_loaded = False
            raise
    return _ENTRIES


# kind -> check(name, factory) of the factories of that kind, set by the module that defines
# the kind's base class (a per_loss factory must build a per_loss Method): refused at register.
FACTORY_CHECKS: dict[str, Callable[[str, Any], None]] = {}
# kind -> the base class whose subclasses are of that kind, set by the catalog.
FACTORY_BASES: dict[str, type] = {}


def _check(name: str, factory: Any, kind: str | None, foreach: Any, observer: bool) -> None:
    where = f"register({name!r})"
    if not isinstance(name, str) or not name:
        raise TypeError(f"register: name must be a non-empty str, got {name!r}")
    if factory is not None and not callable(factory):
        raise TypeError(f"{where}: factory must be callable, got {type(factory).__name__}")
    if foreach is not None and not callable(foreach):
        raise TypeError(f"{where}: foreach must be callable or None, got {type(foreach).__name__}")
    if kind is not None:
        _check_kind(name, kind, foreach, observer)


def _check_kind(name: str, kind: str, foreach: Any, observer: bool) -> None:
    """What ``kind`` allows: checked as given, and again as implied by a class factory."""
    where = f"register({name!r})"
    if kind not in KINDS:
        raise ValueError(f"{where}: kind={kind!r}; allowed: {', '.join(KINDS)}")
    if foreach is not None and kind != "elementwise":
        raise ValueError(f"{where}: a {kind} transform has no foreach form (elementwise only)")
    if observer and kind != "elementwise":
        raise ValueError(f"{where}: observer=True is for elementwise transforms only")


def register(
    name: str,
    factory: Callable[..., Any] | None = None,
    *,
    kind: str | None = None,
    foreach: Callable[..., Any] | None = None,
    observer: bool = False,
    overwrite: bool = False,
):
    """Register ``factory(**args)`` under ``name`` as a transform of ``kind``; usable as a
    decorator (``@register("name", kind="group")``).

    ``kind``: one of ``KINDS`` (see the module docstring for what each factory returns); left
    out, the kind whose base class a class factory subclasses (``gradmod.Method``: per_loss,
    ``gradmod.GroupTransform``: group), else elementwise.
    ``foreach(**args)``: for an element-wise transform, an in-place function over a list
    of gradients for the fused stage. ``observer``: the transform keeps statistics with
    ``GradStats``' protocol and returns None. A name is registered once unless
    ``overwrite=True``. Bad arguments fail here, not when a rule is attached.
    """
    _check(name, factory, kind, foreach, observer)

    def add(f):
        if not callable(f):
            raise TypeError(f"register({name!r}): factory must be callable, got {type(f).__name__}")
        if name in entries() and not overwrite:
            raise ValueError(f"transform {name!r} is already registered; pass overwrite=True to replace it")
        k = _kind_of(name, f, kind)  # after entries(): the catalog's import sets the bases and checks
        _check_kind(name, k, foreach, observer)
        if k in FACTORY_CHECKS:
            FACTORY_CHECKS[k](name, f)
        _ENTRIES[name] = Entry(name, f, k, foreach, observer)
        return f

    return add(factory) if factory is not None else add


def _kind_of(name: str, factory: Any, kind: str | None) -> str:
    """The kind a class factory's base class implies (``FACTORY_BASES``), which a given
    ``kind`` must match; elementwise for a function left without one."""
    implied = [(k, b) for k, b in FACTORY_BASES.items() if isinstance(factory, type) and issubclass(factory, b)]
    if not implied:
        return kind or "elementwise"
    k, base = implied[0]
    if kind is not None and kind != k:
        raise ValueError(
            f"register({name!r}): {factory.__name__} is a {base.__name__}, so a {k} transform, "
            f"not kind={kind!r}; pass kind={k!r} or leave kind out"
        )
    return k


def add_stage_form(name: str, stage: str, factory: Callable[..., Any]) -> None:
    """The form the registered transform ``name`` takes at ``stage`` (a stage its kind does
    not run at), e.g. ``log`` at the per_sample stage."""
    if name not in entries():
        raise ValueError(f"register_at_stage: transform {name!r} is not registered; register it first")
    if stage not in stages.names(available_only=False):
        raise ValueError(f"register_at_stage({name!r}): stage {stage!r}; allowed: {', '.join(stages.names())}")
    if not callable(factory):
        raise TypeError(f"register_at_stage({name!r}): factory must be callable, got {type(factory).__name__}")
    e = _ENTRIES[name]
    _ENTRIES[name] = replace(e, at_stage={**e.at_stage, stage: factory})


def warn_moved(old: str, new: str = "gradmod.register(name, factory, kind=...)") -> None:
    """One release of grace for a door that moved: a DeprecationWarning naming the new one."""
    warnings.warn(f"{old} is deprecated and will be removed in the next release; use {new}", DeprecationWarning, 3)


def register_old_door(*args: Any, **kwargs: Any):
    """Deprecated ``gradmod.hooks.register``: ``gradmod.register``."""
    warn_moved("gradmod.hooks.register")
    return register(*args, **kwargs)


def register_at_stage(name: str, stage: str, factory: Callable[..., Any]) -> None:
    """Deprecated: ``add_stage_form``."""
    warn_moved("gradmod.hooks.registry.register_at_stage", "add_stage_form")
    add_stage_form(name, stage, factory)


def unregister(name: str) -> None:
    """Remove ``name`` (a plugin's or a test's transform); unknown names are ignored."""
    _ENTRIES.pop(name, None)


def names(kind: str | None = None) -> list[str]:
    """The registered transform names (of one kind, if given)."""
    return sorted(n for n, e in entries().items() if kind is None or e.kind == kind)


def entry(name: str) -> Entry:
    """The entry registered under ``name``; a ValueError listing the names otherwise."""
    if name not in entries():
        raise ValueError(f"unknown transform {name!r}; allowed: {', '.join(names())}; {OWN_TRANSFORMS}")
    return _ENTRIES[name]


def factory(name: str) -> Callable[..., Any]:
    """The factory registered under ``name`` (its signature lists the transform's arguments)."""
    return entry(name).factory


def runs_at(name: str, stage: str) -> bool:
    """Whether transform ``name`` may be in a rule at ``stage`` (its kind, or a form there)."""
    e = entry(name)
    return e.kind in stages.get(stage).accepts or stage in e.at_stage


def accepted_at(stage: str) -> list[str]:
    """The transform names a rule at ``stage`` may hold, in registration order."""
    return [n for n in entries() if runs_at(n, stage)]


@dataclass(frozen=True)
class BuiltTransform:
    """One configured transform: its name, arguments and function. ``at``: the stage
    whose form ``fn`` is (``add_stage_form``), None for the entry's own factory."""

    name: str
    args: dict[str, Any] = field(default_factory=dict)
    fn: Any = field(default=None, repr=False, compare=False)
    at: str | None = None
    # argument -> its schedule (gradmod.hooks.schedules); ``args`` holds the values in use
    schedules: Mapping[str, Any] = field(default_factory=dict, compare=False)

    def __call__(self, grad):
        return self.fn(grad)

    @property
    def kind(self) -> str:
        return entry(self.name).kind

    @property
    def observer(self) -> bool:
        """``fn`` is a ``GradStats`` accumulator (the entry's own form of an observer)."""
        return self.at is None and entry(self.name).observer

    @cached_property
    def inplace(self) -> Callable[[list], None] | None:
        """The in-place foreach form, built once (the fused stage calls it every step)."""
        foreach = entry(self.name).foreach if self.at is None else None
        return None if foreach is None else foreach(**self.args)

    def __str__(self) -> str:
        if not self.args:
            return self.name
        shown = with_values(self.args, self.schedules)
        return f"{self.name}({', '.join(f'{k}={_shown(v)}' for k, v in shown.items())})"


def _shown(value: Any) -> str:
    """An argument as a plan shows it: containers in YAML's flow style, schedules by ``str``."""
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k}: {_shown(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(map(_shown, value)) + "]"
    return str(value)


def build(spec: str | Mapping[str, Any], stage: str | None = None) -> BuiltTransform:
    """Build a transform from its config entry (in its form at ``stage`` if it has one
    there); bad names or arguments are a ValueError."""
    name, args = parse_spec(spec)
    e = entry(name)
    at = stage if stage in e.at_stage else None
    make = e.factory if at is None else e.at_stage[at]
    params = inspect.signature(make).parameters
    unknown = [k for k in args if k not in params]
    if unknown:
        allowed = ", ".join(params) or "no arguments"
        raise ValueError(f"transform {name!r} got unknown argument(s) {', '.join(unknown)}; allowed: {allowed}")
    missing = [k for k, p in params.items() if p.default is inspect.Parameter.empty and k not in args]
    if missing:
        raise ValueError(f"transform {name!r} needs argument(s) {', '.join(missing)}")
    fn = make(**args)
    if at is None:
        _check_product(name, e.kind, fn)
    return BuiltTransform(name, args, fn, at)


def _check_product(name: str, kind: str, fn: Any) -> None:
    """What a factory function of one's own built, checked as its kind needs: a config's
    one-line error at attach, not a traceback at the first backward."""
    if kind == "elementwise" and not callable(fn):
        kinds = [f"; a {b.__name__} is kind {k!r}" for k, b in FACTORY_BASES.items() if isinstance(fn, b)]
        raise ValueError(
            f"transform {name!r}: its factory built a {type(fn).__name__}, where an elementwise transform's "
            f"builds a function grad -> Tensor | None{''.join(kinds)} (gradmod.register(..., kind=...))"
        )
    if kind in FACTORY_CHECKS:
        try:
            FACTORY_CHECKS[kind](name, type(fn))  # the checks a class factory of that kind passes
        except TypeError as err:
            raise ValueError(str(err)) from None
    base = FACTORY_BASES.get(kind)
    if base is not None and not isinstance(fn, base):
        raise ValueError(
            f"transform {name!r}: its factory built a {type(fn).__name__}, where a {kind} transform's "
            f"builds a {base.__name__} (subclass gradmod.{base.__name__})"
        )
