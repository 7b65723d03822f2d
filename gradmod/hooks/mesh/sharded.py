"""Parameters that are DTensors (``fully_shard``, ``parallelize_module``, both, HSDP),
and the layouts gradmod refuses.

Each rank holds one piece of such a parameter and of its ``.grad``. Element-wise
transforms run on the pieces unchanged; reductions go through ``gradmod.hooks.mesh.reductions``;
what reads numbers to the host needs the full tensor's values: ``plain`` for a value
already reduced. Refused, each in one line: tensor hooks on such parameters (FSDP2 never
fires them), rules attached before the model was sharded, a model that is one stage of a
pipeline (a norm over the rule would cover that stage only), and rules that act after
backward on parameters an optimizer steps inside backward.
"""

from __future__ import annotations

import sys

import torch
from torch import Tensor

from gradmod.hooks import stages


def is_sharded(t: Tensor) -> bool:
    # Without torch.distributed.tensor imported (FSDP2 imports it) nothing is a DTensor;
    # importing it here would cost every user of the hooks a second at start.
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def plain(t: Tensor) -> Tensor:
    """A plain tensor with ``t``'s full value (no communication for a replicated DTensor)."""
    return t.full_tensor() if is_sharded(t) else t


def refuse_sharded(stage: str, hint: str, targets, params: dict[str, Tensor]) -> None:
    """One line for parameter rules at ``stage`` that cannot run on DTensor parameters (every
    stage but fused): a tensor hook never fires on an FSDP2 parameter (and the DDP meaning,
    each rank's whole local gradient, would need FSDP2's private unsharded parameters);
    per-example or per-task gradients would need the gathered weights in every layer's
    backward. ``hint``: what to do instead."""
    for t in targets:
        if t.kind == "param" and t.stage == stage and is_sharded(params[t.name]):
            raise ValueError(
                f"hooks.{t.rule}: stage {t.stage!r} on {t.name!r}, a parameter sharded into a DTensor "
                f"(fully_shard or parallelize_module); {hint}"
            )


def refuse_pipeline_stage(model: torch.nn.Module) -> None:
    """One line when ``model`` is the module of a ``torch.distributed.pipelining`` stage:
    the rules would see that stage's parameters only (a global norm over one stage)."""
    pipelining = sys.modules.get("torch.distributed.pipelining.stage")
    if pipelining is None:  # never imported: no stage exists
        return
    import gc

    def is_stage(obj) -> bool:
        return isinstance(obj, pipelining._PipelineStageBase)

    # The stage holds the model in its attribute dict (or directly, where dicts are inlined).
    holders = gc.get_referrers(model)
    if any(is_stage(r) or (isinstance(r, dict) and any(map(is_stage, gc.get_referrers(r)))) for r in holders):
        raise ValueError(
            "attach: this model is one stage of a pipeline (torch.distributed.pipelining); gradmod "
            "does not support pipeline parallelism (its norms would cover one stage's parameters only)"
        )


def refuse_optimizer_in_backward(targets, params: dict[str, Tensor], late: bool = False) -> None:
    """One line when a rule that acts after backward (fused, group transforms, per_sample,
    a per_loss method of the task gradients) selects a parameter whose post-accumulate-grad
    hook steps an optimizer (torchtune's ``optimizer_in_bwd``): the step would be taken
    before the rule changes ``.grad``, so the rule would do nothing. Hook-stage rules, loss
    weightings and per_loss ``modules:`` rules still work (their gradients go through
    autograd's accumulation)."""
    known: dict[int, bool] = {}  # one hook is often shared by every parameter
    for t in targets:
        cls = stages.stage_class(t.stage)
        if t.kind != "param" or not cls.after_backward(t):
            continue
        hooks = getattr(params[t.name], "_post_accumulate_grad_hooks", None) or {}
        for h in hooks.values():
            if id(h) not in known:
                known[id(h)] = _steps_an_optimizer(h)
        if any(known[id(h)] for h in hooks.values()):
            when = "since attach" if late else "at attach"
            raise ValueError(
                f"hooks.{t.rule}: {t.name!r} has a post-accumulate-grad hook that steps an optimizer "
                f"inside backward (found {when}), so stage {t.stage!r} would run after the step and do nothing; "
                f"use stage: {stages.DEFAULT} rules (element-wise, before the step){cls.in_backward_instead}, "
                "or step the optimizer after backward"
            )


def _steps_an_optimizer(hook, depth: int = 3) -> bool:
    """Whether an optimizer is within reach of ``hook``: its closure, its bound object, or
    the dicts and lists in them (``optim_dict[param].step()``), a few levels deep."""
    seen: set[int] = set()
    todo = [(hook, 0)]
    while todo:
        obj, level = todo.pop()
        if id(obj) in seen or level > depth:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.optim.Optimizer):
            return True
        if isinstance(obj, dict) or type(obj).__name__ == "WeakKeyDictionary":
            todo.extend((v, level + 1) for v in list(obj.values()))
        elif isinstance(obj, (list, tuple)):
            todo.extend((v, level + 1) for v in obj)
        elif callable(obj):
            cells = getattr(obj, "__closure__", None) or ()
            todo.extend((c.cell_contents, level + 1) for c in cells if _filled(c))
            bound = getattr(obj, "__self__", None)
            if bound is not None:
                todo.append((bound, level + 1))
            wrapped = getattr(obj, "func", None)  # functools.partial
            if wrapped is not None:
                todo.extend([(wrapped, level + 1), (obj.args, level + 1)])
    return False


def _filled(cell) -> bool:
    try:
        return cell.cell_contents is not None
    except ValueError:  # an empty cell
        return False


def watch(model: torch.nn.Module, params: dict[str, Tensor]):
    """A forward pre-hook that checks, once, that ``params`` are still ``model``'s:
    ``fully_shard`` or ``parallelize_module`` after ``attach`` replaces them, and the rules
    would silently do nothing. Then the first backward through the model raises one line
    (the forward itself when its output has no gradient to hook). Returns the handle.
    It runs before every other forward pre-hook: FSDP2's own swap in the gathered
    parameters (DTensors too under tensor parallelism), which are not a replacement."""

    def check(module, inputs) -> None:
        if not torch.is_grad_enabled():
            return
        # torch.func.functional_call swaps plain tensors in for one call: only sharded
        # replacements (DTensors) mean the rules were left behind
        stale = [n for n, p in params.items() if _get(module, n) is not p and is_sharded(_get(module, n))]
        if not stale and any(_get(module, n) is not p for n, p in params.items()):
            return  # look again at the next forward, with the model's own parameters
        handle.remove()
        if stale:
            message = (
                f"attach: the parameters the rules select were replaced after attach ({stale[0]!r} among "
                "them), as fully_shard and parallelize_module do; call gradmod.attach(model, rules) "
                "after fully_shard(model) and parallelize_module"
            )
            once = module.register_forward_hook(lambda m, i, out: _refuse_backward(out, message, once))

    handle = model.register_forward_pre_hook(check, prepend=True)
    return handle


def _refuse_backward(output, message: str, handle) -> None:
    handle.remove()
    out = next(
        (
            t
            for t in (output if isinstance(output, (tuple, list)) else (output,))
            if isinstance(t, Tensor) and t.requires_grad
        ),
        None,
    )
    if out is None:
        raise ValueError(message)

    def refuse(grad):
        raise ValueError(message)

    out.register_hook(refuse)


def _get(module: torch.nn.Module, name: str):
    try:
        return module.get_parameter(name)
    except AttributeError:
        return None
