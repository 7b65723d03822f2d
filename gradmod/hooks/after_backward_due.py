"""A missing ``hooks.after_backward()``, caught in one line.

Rules at a stage that ``after_backward()`` finishes (``Stage.needs_after_backward``:
per_sample, sharpness, fused) leave work due after each backward that reaches them. While
it is due, ``optimizer.step()`` of any ``torch.optim.Optimizer`` holding one of their
parameters, or a forward of the hooked model once the parameters changed (a step taken
without an optimizer), means the loop forgot the call: refused, naming it. A forward with
unchanged parameters is the next micro-batch of gradient accumulation and passes.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from gradmod.hooks import stages
from gradmod.hooks.mesh.sharded import is_sharded

_DUE: weakref.WeakSet[AfterBackwardDue] = weakref.WeakSet()  # watches with work due now
_installed = False  # the one global optimizer-step pre-hook


class AfterBackwardDue:
    """Watches one HookSet's rules: ``sentinels`` maps rule -> (stage, its first parameter)."""

    def __init__(self, model: nn.Module, sentinels: dict[str, tuple[str, nn.Parameter]]):
        self._due: dict[str, tuple[str, nn.Parameter, int]] = {}  # rule -> (stage, parameter, its version)
        self._moving = False  # inside parameters_moved()
        # FSDP2 writes sharded .grad itself: no accumulation to watch there.
        plain = {rule: sp for rule, sp in sentinels.items() if not is_sharded(sp[1])}
        self._handles = [
            p.register_post_accumulate_grad_hook(self._backward_hook(rule, stage)) for rule, (stage, p) in plain.items()
        ]
        if self._handles:
            self._handles.append(model.register_forward_pre_hook(self._before_forward))
            _install()

    def _backward_hook(self, rule: str, stage: str):
        def hook(p: nn.Parameter) -> None:
            self.mark(rule, stage, p)

        return hook

    def mark(self, rule: str, stage: str, param: nn.Parameter) -> None:
        """Work of ``rule`` is due (a stage that writes ``.grad`` itself may call this)."""
        if not self._due:
            _DUE.add(self)
        self._due[rule] = (stage, param, param._version)

    def done(self) -> None:
        """``after_backward()`` ran: nothing is due."""
        if self._due:
            self._due.clear()
            _DUE.discard(self)

    @contextmanager
    def parameters_moved(self) -> Iterator[None]:
        """Inside, parameters move and come back (the sharpness stage's second forward):
        no forward is a missed step, and the versions are read again after."""
        self._moving = True
        try:
            yield
        finally:
            self._moving = False
            self._due = {rule: (stage, p, p._version) for rule, (stage, p, _) in self._due.items()}

    def _before_forward(self, module: nn.Module, args) -> None:
        if self._due and not self._moving and any(p._version != v for _, p, v in self._due.values()):
            raise RuntimeError(self.message())

    def before_step(self, optimizer: torch.optim.Optimizer) -> None:
        held = {id(q) for g in optimizer.param_groups for q in g["params"]}
        if any(id(p) in held for _, p, _ in self._due.values()):
            if torch._C._current_graph_task_id() != -1:  # a step inside backward: optimizer-in-backward
                rule, (stage, _, _) = next(iter(self._due.items()))
                raise ValueError(
                    f"hooks.{rule}: an optimizer steps inside backward (a post-accumulate-grad hook, found "
                    f"since attach), so stage {stage!r} would run after the step and do nothing; use stage: "
                    "hook rules (element-wise, before the step), or step the optimizer after backward"
                )
            raise RuntimeError(self.message())

    def message(self) -> str:
        by_stage: dict[str, list[str]] = {}
        for rule, (stage, _, _) in self._due.items():
            by_stage.setdefault(stage, []).append(rule)
        where = ", ".join(f"rules at stage {s} ({', '.join(r)})" for s, r in by_stage.items())
        return (
            f"gradmod: hooks.after_backward() was not called after the last backward; {where} need it "
            "before optimizer.step()"
        )

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.done()


def _install() -> None:
    global _installed
    if not _installed:
        register_optimizer_step_pre_hook(_before_step)
        _installed = True


def _before_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    if not _DUE:  # the usual case: every loop called after_backward()
        return
    if len(args) > 1 or (kwargs or {}).get("closure") is not None:  # args[0]: the optimizer
        return  # step(closure): the step's last backward (and after_backward) run inside, as Lightning's do
    for watch in list(_DUE):
        watch.before_step(optimizer)


def sentinels(targets: list[Any], params: dict[str, nn.Parameter], timed: Any) -> dict[str, tuple[str, nn.Parameter]]:
    """rule -> (stage, its first parameter) for the rules ``after_backward()`` finishes,
    or whose transforms follow the step clock it advances."""
    changing = {t.rule for t in targets if t.active is not None or any(s.schedules for s in t.steps)}
    changing |= {t.rule for t in targets for s in t.steps if any(s is c for c in timed.clocked)}
    out: dict[str, tuple[str, nn.Parameter]] = {}
    for t in targets:
        if t.kind == "param" and (stages.get(t.stage).needs_after_backward or t.rule in changing):
            out.setdefault(t.rule, (t.stage, params[t.name]))
    return out
