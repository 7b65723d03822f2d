"""The hook-stage chain: one hook per tensor runs the transforms of every rule on it."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from gradmod.hooks import registry as R
from gradmod.hooks.hook.backward_end import BackwardEnd, in_distributed
from gradmod.hooks.hook.ledger import RawLedger
from gradmod.hooks.stats.rows import BIG


def _checked(rule: str, step: R.BuiltTransform, key: str, g: Tensor) -> Tensor | None:
    """Run a step and check what it did: the first call of each hook only, so that the
    check costs nothing afterwards (the version counter shows an in-place change)."""
    version = g._version
    out = step(g)
    where = f"hooks.{rule}: transform {step.name!r} on {key!r}"
    if g._version != version:
        raise ValueError(
            f"{where} modified the gradient in place; a transform must return a new tensor "
            "(e.g. grad.clamp(...), not grad.clamp_(...))"
        )
    if out is None:
        return None
    if not isinstance(out, Tensor):
        raise ValueError(f"{where} returned {type(out).__name__}; a transform returns a Tensor or None")
    got, want = (tuple(out.shape), out.dtype, out.device), (tuple(g.shape), g.dtype, g.device)
    if got != want:
        raise ValueError(
            f"{where} returned shape/dtype/device {got}, the gradient has {want}; a transform must keep all three"
        )
    return out


def _slots(steps: list[tuple[str, R.BuiltTransform]]) -> list[tuple[str, int]]:
    """Each step's (rule, position in the rule's transforms): where its ``log`` rows are batched."""
    seen: dict[str, int] = {}
    out = []
    for rule, _ in steps:
        out.append((rule, seen.get(rule, 0)))
        seen[rule] = seen.get(rule, 0) + 1
    return out


def chain_hook(
    steps: list[tuple[str, R.BuiltTransform]],
    core: Any,
    key: str,
    param: nn.Parameter | None,
    ledger: RawLedger,
    end: BackwardEnd,
):
    """One tensor's hook: the steps of every rule on it, in order. ``log`` steps are
    handed to ``end`` (the stage's ``BackwardEnd``: computed per rule and position for all
    tensors together at the end of backward). The raw gradient goes to ``ledger`` (the
    stage's ``RawLedger``) for the non-finite count, before a transform such as clamp can
    turn inf into a number. ``core``: the clock and the loss scale the stages share
    (``gradmod.hooks.stage.Core``). Under fp16 (``core.grad_scale``, set by ``HookSet.set_grad_scale``) the steps
    see the unscaled gradient, as in fp32, and the result is scaled back for GradScaler;
    scales are powers of two, so this is exact."""
    plan = [(rule, step, step.fn if step.observer else None, slot) for (rule, step), slot in zip(steps, _slots(steps))]
    observes_only = all(obs is not None for _, _, obs, _ in plan)
    # Rules with an ``active`` window: the general hook, which skips them outside it (a set lookup per step).
    windowed = any(rule in core.windows for rule, _ in steps)
    defer = None if windowed else _deferrable(steps, param)
    hook = _general_hook(plan, core, key, param, ledger, end, windowed)
    # The common cases in as few Python steps as can be (a hook runs per tensor per
    # backward, a few µs each): else the general hook, which never defers.
    if defer is not None:
        group = tuple((rule, s.name) for rule, s in steps)  # a rule's steps are the same for all its tensors

        def deferring_hook(grad: Tensor) -> Tensor | None:
            if core.grad_scale is None and defer(param):
                end.defer(group, steps, param, key, ledger)
                return None
            return hook(grad)

        return deferring_hook
    if observes_only and param is not None and param.numel() < BIG and not windowed:
        slots = [(obs, slot) for _, _, obs, slot in plan]
        observers = [obs for obs, _ in slots]

        def observing_hook(grad: Tensor) -> Tensor | None:
            if core.grad_scale is None and not any(obs.histogram for obs in observers):
                end.add_small(slots, grad, param)
                return None
            return hook(grad)

        return observing_hook
    return hook


def _general_hook(
    plan: list, core: Any, key: str, param: nn.Parameter | None, ledger: RawLedger, end: BackwardEnd, windowed: bool
):
    """The hook for any chain: ``plan`` is (rule, step, its observer or None, slot) per step;
    a rule outside its window (``windowed``) is skipped."""
    first = True
    observes_only = all(obs is not None for _, _, obs, _ in plan)

    def hook(grad: Tensor) -> Tensor | None:
        nonlocal first
        scale = core.grad_scale
        g = grad if scale is None else grad.float() * scale.reciprocal()
        off = core.inactive if windowed else ()
        if observes_only:  # nothing changes the gradient: no result to build
            if param is None:
                ledger.note(key, grad, grad, False)
            live = [(obs, g, slot) for rule, _, obs, slot in plan if rule not in off]
            if live:
                _observe(end, live, grad, param)
            return None
        seen: list[tuple[Any, Tensor, tuple[str, int]]] = []  # (GradStats, its gradient, slot)
        changed = False
        for rule, step, obs, slot in plan:
            if rule in off:
                continue
            if obs is not None:
                seen.append((obs, g, slot))
                continue
            out = _checked(rule, step, key, g) if first else step.fn(g)
            if out is not None:
                g, changed = out, True
        first = False
        result = grad if not changed else g if scale is None else (g * scale).to(grad.dtype)
        ledger.note(key, grad, result, param is not None)
        if seen:
            _observe(end, seen, result, param)
        return result

    return hook


def _deferrable(steps: list[tuple[str, R.BuiltTransform]], param: nn.Parameter | None):
    """For a parameter whose chain is transforms with an in-place foreach form, and ``log``
    observers between them: a test of whether this call may leave the gradient to autograd
    and run the chain on ``.grad`` at the end of backward instead (one foreach op per step
    for all such tensors, the observers' rows together, no copy per tensor). It may when
    ``.grad`` is empty, so that it will hold exactly this gradient, and nothing looks at
    ``.grad`` before backward ends: this backward accumulates into it (not
    ``autograd.grad``), builds no graph of its own, no other hook follows on the parameter,
    and no DDP reducer reads it. Else the chain runs in the hook as usual."""
    if param is None or not param.requires_grad or not steps:
        return None
    if not all(s.kind == "elementwise" and (s.observer or s.inplace is not None) for _, s in steps):
        return None
    if all(s.observer for _, s in steps):  # nothing to transform: the observing hook
        return None
    acc = param.view_as(param).grad_fn.next_functions[0][0]  # the parameter's AccumulateGrad node

    def may(p: nn.Parameter) -> bool:
        if p.grad is not None or p._post_accumulate_grad_hooks is not None or len(p._backward_hooks or ()) != 1:
            return False
        return _backward_may_defer(acc)

    return may


_TASK = [-2, False]  # (autograd graph task, whether its hooks may defer): asked once per backward


def _backward_may_defer(acc: Any) -> bool:
    """This backward accumulates into ``.grad`` (not ``autograd.grad``), builds no graph of
    its own, and no DDP reducer reads ``.grad``. The answer is the same for every hook of
    one backward (a parameter's hook runs as its AccumulateGrad node does, under
    ``backward(inputs=...)`` too, or as ``autograd.grad`` captures, where no node runs), so
    it is asked once, at the first hook (hooks run a few µs per tensor)."""
    task = torch._C._current_graph_task_id()
    if task != _TASK[0]:
        ok = not torch.is_grad_enabled() and not in_distributed()
        if ok:
            try:
                ok = torch._C._will_engine_execute_node(acc)
            except RuntimeError:  # autograd.grad(): nothing is accumulated
                ok = False
        _TASK[0], _TASK[1] = task, ok
    return _TASK[1]


def _observe(end: BackwardEnd, seen: list, result: Tensor, param: nn.Parameter | None) -> None:
    for obs, g, _ in seen:
        if obs.histogram:  # the step before a log point: bin at once (the rows still batch)
            obs.observe_histogram(g)
    end.add(seen, result, param)


def on_filling(hook, fills_grad):
    """``hook`` in the backward that fills ``.grad`` only (``fills_grad()``: ``Core.fills_grad``):
    under a gradient the loss takes of itself (``torch.autograd.grad``, a gradient penalty) the
    gradient passes as torch gives it, untransformed, unobserved, uncounted."""

    def filling_hook(grad: Tensor) -> Tensor | None:
        return hook(grad) if fills_grad() else None

    return filling_hook


def output_hook(chain, rules: list[str], module: str):
    """A ``modules:`` rule's forward hook: ``chain`` on the tensor the module returns, or on
    each tensor of a flat tuple or list. Other outputs (a dict, a nested tuple) would be
    left alone while the plan lists them, so they are refused at the first forward."""

    def forward_hook(mod: nn.Module, inputs: Any, output: Any) -> None:
        outputs = output if isinstance(output, (tuple, list)) else (output,)
        if not all(isinstance(t, Tensor) or t is None for t in outputs):
            kinds = sorted({type(t).__name__ for t in outputs if not isinstance(t, Tensor) and t is not None})
            inside = f" holding {', '.join(kinds)}" if outputs is output else ""
            keys = " and ".join(f"hooks.{r}.modules" for r in rules)
            raise ValueError(
                f"{keys}: module {module!r} returns {type(output).__name__}"
                f"{inside}; a modules: rule needs a module that returns a tensor or a flat tuple of "
                "tensors (select its parameters with params: instead)"
            )
        for t in outputs:
            if t is not None and t.requires_grad:
                t.register_hook(chain)

    return forward_hook
