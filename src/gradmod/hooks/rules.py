"""Hook rules: select tensors by name, attach their transforms, keep every handle.

A rule is ``{"params": glob(s), "exclude": glob(s), "transforms": [...], "stage": ...}``
or ``{"modules": glob(s), ...}``. ``params`` selects ``model.named_parameters()`` and
transforms each parameter's gradient; ``modules`` selects ``model.named_modules()`` and
transforms the gradient of the module's *output* (the articles' ``x.register_hook``
inside ``forward``). Several rules on one tensor chain in config order within a stage;
hook-stage transforms run before fused ones (``HookSet.plan`` lists that order).

Stages (``params`` rules only; ``modules`` rules always run as hooks):

* ``hook``: ``Tensor.register_hook`` on the parameter; sees each backward's local
  gradient before it is accumulated into ``.grad`` (and before DDP's all-reduce).
* ``fused``: ``HookSet.after_backward()`` transforms the accumulated ``.grad`` tensors,
  grouped per transform with ``torch._foreach_*`` ops, once per optimizer step; a
  transform without a foreach form runs per tensor, each with its own state.
"""

from __future__ import annotations

import difflib
import fnmatch
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch
from torch import Tensor, nn

from torch.utils.weak import WeakIdKeyDictionary

from gradmod.hooks import group as _group  # noqa: F401  (registers the group transforms)
from gradmod.hooks import transforms as T
from gradmod.hooks.fused import fused_steps, run_fused
from gradmod.hooks.stats import GradStats, batch_rows

STAGES = ("hook", "fused")
RULE_KEYS = ("params", "modules", "exclude", "transforms", "stage")

# model -> its live HookSet, so attaching again replaces rather than doubles the hooks.
_ATTACHED: "weakref.WeakKeyDictionary[nn.Module, HookSet]" = weakref.WeakKeyDictionary()
# hooked parameter or module -> the live HookSet holding its hooks, whatever root reached it.
_OWNERS = WeakIdKeyDictionary()


@dataclass
class Target:
    """One selected tensor and the transforms (in order) a rule applies to it."""

    rule: str
    kind: str  # "param" | "module"
    name: str
    stage: str
    steps: list[T.Step]

    @property
    def key(self) -> str:
        """The tensor's name in plans and statistics: a module's output is ``name:output``."""
        return self.name if self.kind == "param" else f"{self.name}:output"


def _patterns(rule: str, key: str, value: Any) -> list[str]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, Iterable) or isinstance(value, Mapping) or not value or \
            not all(isinstance(v, str) and v for v in value):
        raise ValueError(f"hooks.{rule}.{key}: {value!r} must be a glob or a non-empty list of globs")
    return list(value)


def name_hint(pattern: str, names: list[str]) -> str:
    """What to say after a name or glob matched nothing: the close names, else a few real ones."""
    close = difflib.get_close_matches(pattern, names, n=5, cutoff=0.4)
    return f"close names: {', '.join(close)}" if close else f"names look like: {', '.join(names[:5])}"


def _no_match(rule: str, key: str, pattern: str, names: list[str], what: str) -> ValueError:
    return ValueError(f"hooks.{rule}.{key}: {pattern!r} matches no {what}; {name_hint(pattern, names)}")


def select(rule: str, spec: Mapping[str, Any], names: list[str], what: str) -> list[str]:
    """The names a rule selects, in model order; a pattern matching nothing is an error."""
    key = "params" if "params" in spec else "modules"
    chosen: set[str] = set()
    for pattern in _patterns(rule, key, spec[key]):
        hits = fnmatch.filter(names, pattern)
        if not hits:
            raise _no_match(rule, key, pattern, names, what)
        chosen.update(hits)
    if spec.get("exclude") is not None:
        for pattern in _patterns(rule, "exclude", spec["exclude"]):
            hits = fnmatch.filter(names, pattern)
            if not hits:
                raise _no_match(rule, "exclude", pattern, names, what)
            chosen.difference_update(hits)
    if not chosen:
        raise ValueError(f"hooks.{rule}: exclude removes every {what} the rule selected")
    return [n for n in names if n in chosen]


def build_targets(model: nn.Module, rules: Mapping[str, Mapping[str, Any]] | None,
                  stage: str = "hook") -> list[Target]:
    """Check the rules against the model and return what to attach, in config order."""
    if not isinstance(rules, Mapping) and rules is not None:
        raise ValueError(f"hooks must be a mapping of rule name to rule, got {type(rules).__name__}")
    params = [n for n, p in model.named_parameters() if p.requires_grad]
    modules = [n for n, _ in model.named_modules() if n]
    targets: list[Target] = []
    for rule, spec in (rules or {}).items():
        if not isinstance(spec, Mapping):
            raise ValueError(f"hooks.{rule}: a rule must be a mapping with params or modules and transforms")
        spec = {k: v for k, v in spec.items() if v is not None}  # a null key is an unset one
        unknown = [k for k in spec if k not in RULE_KEYS]
        if unknown:
            raise ValueError(f"hooks.{rule}: unknown key(s) {', '.join(map(str, unknown))}; allowed: {', '.join(RULE_KEYS)}")
        if ("params" in spec) == ("modules" in spec):
            raise ValueError(f"hooks.{rule}: give exactly one of 'params' or 'modules'")
        targets.extend(_rule_targets(rule, spec, params, modules, stage))
    _check_observer_keys(targets)
    return targets


def _rule_stage(rule: str, spec: Mapping[str, Any], kind: str, transforms: list, default: str) -> str:
    """The rule's stage: its own, else the default; a rule with a group transform runs
    fused (the only stage where all its gradients are there at once)."""
    rule_stage = spec.get("stage") or default
    if rule_stage not in STAGES:
        raise ValueError(f"hooks.{rule}.stage: {rule_stage!r} is not a stage; allowed: {', '.join(STAGES)}")
    if kind == "module" and spec.get("stage") == "fused":
        raise ValueError(f"hooks.{rule}.stage: 'fused' needs params (accumulated .grad); modules rules run as hooks")
    try:
        groups = [n for n in (T.parse_spec(t)[0] for t in transforms) if T.is_group(n)]
    except ValueError as e:
        raise ValueError(f"hooks.{rule}.transforms: {e}") from None
    if not groups:
        return "hook" if kind == "module" else rule_stage
    if kind == "module":
        raise ValueError(f"hooks.{rule}: group transform {groups[0]!r} needs params (accumulated .grad), not modules")
    if spec.get("stage") == "hook":
        raise ValueError(f"hooks.{rule}.stage: group transform {groups[0]!r} acts on all the rule's gradients "
                         "after backward; it runs at stage 'fused' only")
    return "fused"


def _rule_targets(rule: str, spec: Mapping[str, Any], params: list[str], modules: list[str],
                  default_stage: str) -> list[Target]:
    kind = "param" if "params" in spec else "module"
    transforms = spec.get("transforms")
    if isinstance(transforms, (str, Mapping)):
        transforms = [transforms]
    if not transforms:
        raise ValueError(f"hooks.{rule}.transforms: give at least one of {', '.join(T.names())}")
    stage = _rule_stage(rule, spec, kind, transforms, default_stage)
    names = select(rule, spec, params if kind == "param" else modules,
                   "parameter (see model.named_parameters())" if kind == "param"
                   else "module (see model.named_modules())")
    shared: dict[int, T.Step] = {}  # a group transform: one instance for all the rule's tensors
    targets = []
    for name in names:
        try:  # per tensor: observers and stateful transforms keep their own state
            steps = [shared.get(i) or T.build(t) for i, t in enumerate(transforms)]
        except ValueError as e:
            raise ValueError(f"hooks.{rule}.transforms: {e}") from None
        shared.update((i, st) for i, st in enumerate(steps) if st.group)
        targets.append(Target(rule, kind, name, stage, _label_observers(steps, stage)))
    return targets


def _label_observers(steps: list[T.Step], stage: str) -> list[T.Step]:
    """``log`` first in a chain of several steps is ``pre``, last is ``post`` (an explicit
    ``label`` wins); a chain that starts and ends with ``log`` pairs the two, so ``post``
    reports the fraction of elements the transforms between them changed."""
    if len(steps) < 2:
        return steps
    out = list(steps)
    for i, label in ((0, "pre"), (len(out) - 1, "post")):
        step = out[i]
        if isinstance(step.fn, GradStats) and step.fn.label is None:
            out[i] = T.build({"name": step.name, **step.args, "label": label})
    first, last = out[0].fn, out[-1].fn
    if isinstance(first, GradStats) and isinstance(last, GradStats):
        last.pre = first
        # The fused stage transforms .grad in place, so pre must keep a copy.
        first.keep = "clone" if stage == "fused" else "ref"
    return out


def observer_key(target: Target, obs: GradStats) -> str:
    """The key of an observer's statistics: ``tensor`` or ``tensor/label``."""
    return f"{target.key}/{obs.label}" if obs.label else target.key


def _check_observer_keys(targets: list[Target]) -> None:
    seen: dict[str, str] = {}
    for key, rule, _ in _group_steps(targets):
        if key in seen:
            raise ValueError(f"hooks.{rule}: transform {key.partition('/')[2]!r} appears twice in the rule; "
                             "give it once (its statistics are keyed by rule and transform)")
        seen[key] = rule
    for t in targets:
        for s in t.steps:
            if isinstance(s.fn, GradStats):
                key = observer_key(t, s.fn)
                if key in seen:
                    raise ValueError(f"hooks.{t.rule}: its log of {key!r} has the same key as one in rule "
                                     f"{seen[key]!r}; give one of them a distinct label, e.g. {{name: log, label: {t.rule}}}")
                seen[key] = t.rule


def _checked(rule: str, step: T.Step, key: str, g: Tensor) -> Tensor | None:
    """Run a step and check what it did: the first call of each hook only, so that the
    check costs nothing afterwards (the version counter shows an in-place change)."""
    version = g._version
    out = step(g)
    where = f"hooks.{rule}: transform {step.name!r} on {key!r}"
    if g._version != version:
        raise ValueError(f"{where} modified the gradient in place; a transform must return a new tensor "
                         "(e.g. grad.clamp(...), not grad.clamp_(...))")
    if out is None:
        return None
    if not isinstance(out, Tensor):
        raise ValueError(f"{where} returned {type(out).__name__}; a transform returns a Tensor or None")
    got, want = (tuple(out.shape), out.dtype, out.device), (tuple(g.shape), g.dtype, g.device)
    if got != want:
        raise ValueError(f"{where} returned shape/dtype/device {got}, the gradient has {want}; "
                         "a transform must keep all three")
    return out


def _chain(steps: list[tuple[str, T.Step]], hooks: "HookSet", key: str, param: nn.Parameter | None):
    """One tensor's hook: the steps of every rule on it, in order. ``log`` steps are
    handed to ``hooks`` (computed for all tensors together at the end of backward).
    A chain that replaces the gradient leaves the raw one with ``hooks`` for the
    non-finite count (before a transform such as clamp can turn inf into a number).
    Under fp16 (``hooks.grad_scale`` set) the steps see the unscaled gradient, as in
    fp32, and the result is scaled back for GradScaler; scales are powers of two, so
    this is exact."""
    first = True

    def hook(grad: Tensor) -> Tensor:
        nonlocal first
        scale = hooks.grad_scale
        g = grad if scale is None else grad.float() * scale.reciprocal()
        seen: list[tuple[GradStats, Tensor]] = []
        changed = False
        for rule, step in steps:
            if isinstance(step.fn, GradStats) and not step.fn.histogram:
                seen.append((step.fn, g))
                continue
            out = _checked(rule, step, key, g) if first else step(g)
            if out is not None:
                g, changed = out, True
        first = False
        result = grad if not changed else g if scale is None else (g * scale).to(grad.dtype)
        hooks._after_chain(key, grad, result, seen, param)
        return result

    return hook


def _group_steps(targets: list[Target]) -> list[tuple[str, str, T.Step]]:
    """(``rule/transform``, rule, step) of every group transform, once each, in config order."""
    out, seen = [], set()
    for t in targets:
        for s in t.steps:
            if s.group and id(s) not in seen:
                seen.add(id(s))
                out.append((f"{t.rule}/{s.name}", t.rule, s))
    return out


class HookSet:
    """The hooks one ``attach`` call registered. ``remove()`` (or leaving a ``with``
    block) removes every handle; ``after_backward()`` runs the fused stage."""

    def __init__(self, model: nn.Module, targets: list[Target]):
        self.targets = targets
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self.grad_scale: Tensor | None = None  # GradScaler's scale (fp16): hooks then unscale first
        self._raw: list[tuple[str, Tensor]] = []  # (tensor, raw gradient a chain replaced) since take_raw()
        self._raw_counts: list[tuple[str, Tensor]] = []  # (module output, its count of non-finite entries)
        self.replaced: set[str] = set()  # parameters whose chain replaced the gradient since take_raw()
        self._pending: list[tuple[GradStats, Any]] = []  # log observations of this backward
        self._pairs: list[tuple[GradStats, Any, GradStats, Any]] = []  # (pre, its source, post, its source)
        params = dict(model.named_parameters())
        modules = dict(model.named_modules())
        # One hook per tensor: its transforms from every rule, chained in config order.
        hooked: dict[str, tuple[Target, list[tuple[str, T.Step]]]] = {}
        for t in targets:
            if t.stage == "hook":
                hooked.setdefault(t.key, (t, []))[1].extend((t.rule, s) for s in t.steps)
        for key, (t, steps) in hooked.items():
            if t.kind == "param":
                self._handles.append(params[t.name].register_hook(_chain(steps, self, key, params[t.name])))
            else:
                self._handles.append(modules[t.name].register_forward_hook(_output_hook(_chain(steps, self, key, None))))
        self.hooked_params = {t.name for t, _ in hooked.values() if t.kind == "param"}
        self._fused = fused_steps(targets, params)  # (rule, step index) groups in config order
        self._groups = [(key, s.fn) for key, _, s in _group_steps(targets)]
        # Every tensor this set transforms, so another attach call cannot hook it twice.
        self.owned = [params[t.name] if t.kind == "param" else modules[t.name] for t in targets]
        for obj in self.owned:
            _OWNERS[obj] = self

    def _in_order(self) -> list[Target]:
        """The targets in application order: hook-stage ones (they run during backward)
        before fused ones (after it), each in config order."""
        return [t for stage in ("hook", "fused") for t in self.targets if t.stage == stage]

    @property
    def plan(self) -> list[tuple[str, list[str]]]:
        """(tensor name, transform names) in application order; module outputs as ``name:output``."""
        out: dict[str, list[str]] = {}
        for t in self._in_order():
            out.setdefault(t.key, []).extend(s.name for s in t.steps)
        return list(out.items())

    def describe(self) -> list[dict[str, Any]]:
        """The plan with rules, stages and arguments, for printing and saving (application order)."""
        return [{"tensor": t.key, "rule": t.rule, "stage": t.stage, "transforms": [str(s) for s in t.steps]}
                for t in self._in_order()]

    def format_plan(self) -> str:
        if not self.targets:
            return "hook plan: no rules"
        width = max(len(d["tensor"]) for d in self.describe())
        lines = [f"  {d['tensor']:<{width}}  {d['stage']:<5}  {d['rule']}: {' -> '.join(d['transforms'])}"
                 for d in self.describe()]
        return "hook plan:\n" + "\n".join(lines)

    @property
    def has_fused(self) -> bool:
        return bool(self._fused)

    def after_backward(self) -> bool:
        """Run the fused stage on the accumulated gradients (call before optimizer.step).
        Returns True when the optimizer step must be skipped (``zclip(on_spike="skip")``
        saw a spike: only then is the host read), False otherwise."""
        return run_fused(self._fused)

    def _after_chain(self, key: str, raw: Tensor, result: Tensor, seen: list[tuple[GradStats, Tensor]],
                     param: nn.Parameter | None) -> None:
        """Keep what one chain call leaves for later: the raw gradient it replaced (for the
        non-finite count) and its ``log`` observations (for the end of backward)."""
        if param is None:  # a module output: count now rather than keep activation gradients alive
            self._raw_counts.append((key, torch.count_nonzero(raw * 0)))
        elif result is not raw:
            self._raw.append((key, raw))
            self.replaced.add(key)
        if not seen:
            return
        if not self._pending and not self._pairs:
            torch.autograd.Variable._execution_engine.queue_callback(self._flush_logs)
        # Holding the tensor autograd is about to store in an empty .grad would make it copy
        # the tensor; read that one from .grad at the end of backward instead.
        steal = param is not None and param.grad is None and not _distributed()
        sources = [(obs, param if steal and t is result else t) for obs, t in seen]
        waiting: dict[int, tuple[GradStats, Any]] = {}  # pre observers of this call, until their post
        for obs, src in sources:
            if obs.pre is not None and id(obs.pre) in waiting:
                self._pairs.append((*waiting.pop(id(obs.pre)), obs, src))
            elif obs.keep is not None:
                waiting[id(obs)] = (obs, src)
            else:
                self._pending.append((obs, src))
        self._pending.extend(waiting.values())

    def _flush_logs(self) -> None:
        """End of backward: the rows of every pending ``log`` observation, computed together."""
        pairs, singles = self._pairs, self._pending
        self._pairs, self._pending = [], []
        order = [p for p, _, _, _ in pairs] + [q for _, _, q, _ in pairs] + [o for o, _ in singles]
        sources = [s for _, s, _, _ in pairs] + [s for _, _, _, s in pairs] + [s for _, s in singles]
        tensors = [s.grad if isinstance(s, nn.Parameter) else s for s in sources]
        if not tensors:
            return
        for obs, row in zip(order, batch_rows(tensors, len(pairs))):
            obs.add_row(row)

    def observers(self) -> list[tuple[str, Any]]:
        """(statistics key, accumulator) for every ``log`` transform attached (key
        ``tensor`` or ``tensor/label``), then every group transform's ``NormRecord``
        (key ``rule/transform``: total norm before it, clip coefficient)."""
        logs = [(observer_key(t, s.fn), s.fn) for t in self.targets for s in t.steps
                if isinstance(s.fn, GradStats)]
        return logs + [(key, fn.record) for key, fn in self._groups]

    def read_stats(self) -> dict[str, dict[str, Any]]:
        """Every ``log`` accumulator's window (and histogram, if one was taken), read
        with a single host sync."""
        pending = []
        for key, obs in self.observers():
            calls, acc = obs.take()
            if acc is not None:
                pending.append((key, obs, calls, acc, obs.pre is not None))
        if not pending:
            return {}
        device = pending[0][3].device
        flat = torch.cat([acc.to(device) for _, _, _, acc, _ in pending]).tolist()
        out, i = {}, 0
        for key, obs, calls, acc, paired in pending:
            out[key] = obs.summarize(calls, flat[i:i + len(acc)], paired)
            i += len(acc)
        return out

    def state_dict(self) -> dict[str, Any]:
        """What the hooks carry from step to step (the ``log`` windows in progress, the
        group transforms' state such as zclip's running mean and variance), for
        checkpoints: resuming with ``load_state_dict`` continues bit for bit."""
        return {"log_windows": {key: obs.state_dict() for key, obs in self.observers()},
                "group": {key: fn.state_dict() for key, fn in self._groups}}

    def load_state_dict(self, state: Mapping[str, Any], device: torch.device | None = None) -> None:
        """Restore ``state_dict()``'s windows; ``device``: where this run's gradients are.
        Windows of tensors this HookSet does not observe are ignored."""
        windows = state.get("log_windows", {})
        for key, obs in self.observers():
            if key in windows:
                obs.load_state_dict(windows[key], device)
        groups = state.get("group", {})
        for key, fn in self._groups:
            if key in groups:
                fn.load_state_dict(groups[key], device)

    def set_histograms(self, on: bool) -> None:
        """Bin the gradients of the next calls on the device (for the step before a read)."""
        for _, obs in self.observers():
            obs.histogram = on

    def take_raw_parts(self) -> tuple[list[tuple[str, Tensor]], list[tuple[str, Tensor]], set[str]]:
        """What the hooks kept since the last call, and a fresh start: (tensor name, raw
        gradient to count) for chains that replaced a parameter's gradient, (module
        output, count) already counted, and the parameters whose raw gradient is not in
        their ``.grad``. ``NonFiniteGuard`` counts the tensors together with the rest."""
        out = (self._raw, self._raw_counts, self.replaced)
        self._raw, self._raw_counts, self.replaced = [], [], set()
        return out

    def take_raw(self) -> list[tuple[str, Tensor]]:
        """(tensor name, device count of non-finite raw gradient entries) the hooks saw
        replaced since the last call (summed per name), and a fresh start; no host sync.
        Gradients a chain left unchanged are in ``.grad``, counted there."""
        raw, counted, _ = self.take_raw_parts()
        counts = torch._foreach_norm(torch._foreach_mul([t for _, t in raw], 0), 0) if raw else []
        out: dict[str, Tensor] = {}
        for name, c in [(n, c) for (n, _), c in zip(raw, counts)] + counted:
            out[name] = c if name not in out else out[name] + c
        return list(out.items())

    def __len__(self) -> int:
        return len(self._handles)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._fused.clear()
        self.take_raw_parts()
        self._pairs, self._pending = [], []
        for obj in self.owned:  # free the tensors for another attach call
            if _OWNERS.get(obj) is self:
                del _OWNERS[obj]
        self.owned = []

    def __enter__(self) -> "HookSet":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _output_hook(chain):
    def forward_hook(module: nn.Module, inputs: Any, output: Any) -> None:
        for t in output if isinstance(output, (tuple, list)) else (output,):
            if isinstance(t, Tensor) and t.requires_grad:
                t.register_hook(chain)

    return forward_hook


def load_rules(rules: Mapping[str, Any] | str | Path) -> dict[str, Any]:
    """Rules from a mapping or a hook config file (``conf/hooks/clip.yaml``). A file's
    ``defaults`` list is Hydra's composition (it gives each rule every key), not a rule."""
    if isinstance(rules, (str, Path)):
        import yaml  # only for files: the core needs no YAML otherwise

        rules = yaml.safe_load(Path(rules).read_text()) or {}
        if isinstance(rules, Mapping):
            rules = {k: v for k, v in rules.items() if k != "defaults"}
    if not isinstance(rules, Mapping):
        raise ValueError(f"rules must be a mapping of rule name to rule or a hook config file, got {type(rules).__name__}")
    return dict(rules)


def attach(model: nn.Module, rules: Mapping[str, Mapping[str, Any]] | None,
           stage: str = "hook") -> HookSet:
    """Attach ``rules`` to ``model`` and return the ``HookSet`` holding every handle.

    ``stage`` is the default for rules that do not set one (a rule with a group
    transform runs fused). Attaching again to the same model first removes the hooks of
    the previous call, so hooks never double; tensors that carry a live HookSet attached
    through another module (a wrapper, a submodule) are refused: remove that one first.
    """
    if stage not in STAGES:
        raise ValueError(f"stage {stage!r} is not a stage; allowed: {', '.join(STAGES)}")
    targets = build_targets(model, rules, stage)  # validate everything before touching the model
    previous = _ATTACHED.get(model)
    _refuse_overlap(model, targets, previous)
    if previous is not None:
        previous.remove()
    hooks = HookSet(model, targets)
    _ATTACHED[model] = hooks
    return hooks


def _refuse_overlap(model: nn.Module, targets: list[Target], previous: HookSet | None) -> None:
    """A one-line error naming the tensors another live HookSet already transforms."""
    params, modules = dict(model.named_parameters()), dict(model.named_modules())
    taken = []
    for t in targets:
        owner = _OWNERS.get(params[t.name] if t.kind == "param" else modules[t.name])
        if owner is not None and owner is not previous and t.key not in taken:
            taken.append(t.key)
    if taken:
        shown = ", ".join(taken[:5]) + (f" and {len(taken) - 5} more" if len(taken) > 5 else "")
        raise ValueError(f"attach: {shown} already carry hooks from another attach call (through another "
                         "module); call remove() on that HookSet first, or attach once to the outer model")
