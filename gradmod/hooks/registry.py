"""The one registry of transforms: name -> entry (factory, kind, optional forms).

A config entry ``{name: clamp, min: -0.01, max: 0.01}`` becomes
``entry("clamp").factory(min=-0.01, max=0.01)``. The entry's *kind* says what the factory
builds and so at which stage it may run (``gradmod.hooks.stages``):

* ``elementwise``: ``grad -> Tensor | None`` on one tensor, never modifying ``grad`` in
  place (``None`` leaves it as it is); stage ``hook`` or ``fused``, the rule's choice. An
  optional ``foreach`` factory builds an in-place form over a list of ``.grad`` tensors,
  used by the fused stage (without one it calls the function per tensor).
* ``group``: one object per rule acting on all its gradients together, a subclass of
  ``gradmod.GroupTransform`` (``apply_(params, grads)`` in place); implies
  stage ``fused``.
* ``per_sample``: read by the per_sample stage on each example's gradient (as
  ``per_sample_clip``); implies stage ``per_sample``.
* ``per_loss``: read by the per_loss stage on each loss's gradient; implies ``per_loss``.
* ``sharpness``: how the sharpness stage perturbs a rule's parameters before its second
  forward and backward (``sam``, ``asam``: ``gradmod.hooks.sharpness``); implies ``sharpness``.
* ``penalty``: a term the loss gains from its own gradient (``grad_penalty``,
  ``input_grad_penalty``: ``gradmod.hooks.penalty``); implies ``penalty``.

An entry may also have a form at another stage (``add_stage_form``): ``log`` is
element-wise, and at the per_sample stage keeps per-example statistics instead.

The shipped transforms are the rows of ``gradmod.hooks.catalog``, which the first read of the
table takes in (``entries``), each factory imported when its entry is first used; one's own go
through ``gradmod.register``.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field, replace
from functools import cache, cached_property
from typing import Any, Callable, Mapping

from gradmod.hooks import catalog, stages
from gradmod.hooks.rules.syntax import parse_spec
from gradmod.hooks.schedules import with_values

KINDS = ("elementwise", "group", "per_sample", "per_loss", "sharpness", "penalty")

# How a transform of one's own gets a name (train.py imports the modules named in plugins).
OWN_TRANSFORMS = "a transform of your own is registered with gradmod.register, in a module given as plugins=[my_pkg.x]"

Made = Callable[..., Any]


def _resolve(where: Made | str) -> Made:
    """A factory, or where one lives (``"module:attribute"``, the catalog's form): the factory."""
    if not isinstance(where, str):
        return where
    module, _, attribute = where.partition(":")
    return getattr(importlib.import_module(module), attribute)


@dataclass(frozen=True)
class Entry:
    """A registered transform: what builds it and what kind it is. A shipped entry names its
    factories by where they live; each is imported when first asked for."""

    name: str
    make: Made | str
    kind: str = "elementwise"
    make_foreach: Made | str | None = None  # elementwise: in-place form over a list of gradients
    observer: bool = False  # keeps statistics and returns None (``log``: a GradStats accumulator)
    forms: Mapping[str, Made | str] = field(default_factory=dict)  # stage -> factory there

    @cached_property
    def factory(self) -> Made:
        return _resolve(self.make)

    @cached_property
    def foreach(self) -> Made | None:
        return None if self.make_foreach is None else _resolve(self.make_foreach)

    @cached_property
    def at_stage(self) -> Mapping[str, Made]:
        return {stage: _resolve(form) for stage, form in self.forms.items()}

    @property
    def stage(self) -> str | None:
        """The stage this kind forces on a rule; None: the rule chooses (element-wise)."""
        implied = stages.implied_by(self.kind)
        return None if implied is None else implied.name


_ENTRIES: dict[str, Entry] = {}
_shipped_read = False


def entries() -> dict[str, Entry]:
    """The table, the shipped transforms in it (``gradmod.hooks.catalog``, read on the first call)."""
    global _shipped_read
    if not _shipped_read:
        _shipped_read = True
        for name, kind, make, forms in catalog.SHIPPED:
            _ENTRIES[name] = Entry(
                name, make, kind, forms.get("foreach"), forms.get("observer", False), forms.get("at_stage", {})
            )
    return _ENTRIES


@cache  # a constant table: resolved once, not at every build
def kind_bases() -> dict[str, type]:
    """kind -> the base class whose subclasses are of that kind (``catalog.KIND_BASES``)."""
    return {kind: _resolve(where) for kind, where in catalog.KIND_BASES.items()}


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
        k = _kind_of(name, f, kind)
        _check_kind(name, k, foreach, observer)
        if isinstance(f, type) and k in catalog.KIND_CHECKS:  # a per_loss class defines what its kind needs
            _resolve(catalog.KIND_CHECKS[k])(name, f)
        _ENTRIES[name] = Entry(name, f, k, foreach, observer)
        return f

    return add(factory) if factory is not None else add


def _kind_of(name: str, factory: Any, kind: str | None) -> str:
    """The kind a class factory's base class implies (``kind_bases``), which a given
    ``kind`` must match; elementwise for a function left without one."""
    if not isinstance(factory, type):
        return kind or "elementwise"
    implied = [(k, b) for k, b in kind_bases().items() if issubclass(factory, b)]
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
        raise ValueError(f"add_stage_form: transform {name!r} is not registered; register it first")
    if stage not in stages.names():
        raise ValueError(f"add_stage_form({name!r}): stage {stage!r}; allowed: {', '.join(stages.names())}")
    if not callable(factory):
        raise TypeError(f"add_stage_form({name!r}): factory must be callable, got {type(factory).__name__}")
    e = _ENTRIES[name]
    _ENTRIES[name] = replace(e, forms={**e.forms, stage: factory})


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
    return e.kind in stages.get(stage).accepts or stage in e.forms


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
    return build_parsed(*parse_spec(spec), stage)


def build_parsed(name: str, args: Mapping[str, Any], stage: str | None = None) -> BuiltTransform:
    """``build`` of an entry already read (``parse_spec``): transform ``name`` with ``args``."""
    args = dict(args)
    e = entry(name)
    at = stage if stage in e.forms else None
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
        _check_product(name, e.kind, fn, checked=isinstance(make, type) and isinstance(fn, make))
    return BuiltTransform(name, args, fn, at)


def _check_product(name: str, kind: str, fn: Any, checked: bool) -> None:
    """What a factory function of one's own built, checked as its kind needs: a config's
    one-line error at attach, not a traceback at the first backward. ``checked``: the factory
    is a class, which ``register`` already put through its kind's check, and built one of its own."""
    if kind == "elementwise" and not callable(fn):
        kinds = [f"; a {b.__name__} is kind {k!r}" for k, b in kind_bases().items() if isinstance(fn, b)]
        raise ValueError(
            f"transform {name!r}: its factory built a {type(fn).__name__}, where an elementwise transform's "
            f"builds a function grad -> Tensor | None{''.join(kinds)} (gradmod.register(..., kind=...))"
        )
    if kind in catalog.KIND_CHECKS and not checked:
        try:
            _resolve(catalog.KIND_CHECKS[kind])(name, type(fn))  # the checks a class factory of that kind passes
        except TypeError as err:
            raise ValueError(str(err)) from None
    base = kind_bases().get(kind)
    if base is not None and not isinstance(fn, base):
        raise ValueError(
            f"transform {name!r}: its factory built a {type(fn).__name__}, where a {kind} transform's "
            f"builds a {base.__name__} (subclass gradmod.{base.__name__})"
        )
