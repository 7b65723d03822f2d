"""The per_sample stage: each example's gradient, clipped, summed and noised (DP-SGD).

A forward hook on every module that directly holds a parameter of a per_sample rule
keeps the module's input (detached) and registers a hook on its output tensor, which
receives the output gradient during backward (a tensor hook, not a full backward hook,
so in-place operations after the module, as in ResNet, are fine). At the end of each
backward the stage computes, per rule, each example's gradient norm over all the rule's
parameters (flat clipping), the clip factors ``min(1, C / (|g_i| + 1e-6))``, and adds
``sum_i c_i g_i`` (one weighted matmul per layer) to the step's sums; the plain gradient
autograd put in ``.grad`` is dropped. ``finish()`` (``HookSet.after_backward``) adds
``N(0, (sigma C)^2)`` once and divides by the step's (expected) number of examples.
Nothing per example outlives the backward that made it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from gradmod.hooks.per_sample.assign import Layer, assign
from gradmod.hooks.per_sample.form import Inputs, as_rows
from gradmod.hooks.per_sample.layers import batch_dependent
from gradmod.hooks.per_sample.sample_rules import check_targets, per_sample_rules
from gradmod.hooks.per_sample.stats import PerSampleClip
from gradmod.hooks.per_sample.tracing import batch_dim, detach_input, followed_forward, param_or_none, trace
from gradmod.hooks.stage import Core, Loop, Stage

LOSS_REDUCTIONS = ("mean", "sum")
EPS = 1e-6  # Opacus' guard against a zero norm in the clip factor


@dataclass
class Call:
    """One forward call of a layer: its input and, after backward, its output gradients."""

    layer: Layer
    inputs: Any
    shapes: list[tuple[torch.Size, torch.dtype, torch.device]]
    grads: list[Tensor | None] = field(default_factory=list)


class PerSampleStage(Stage):
    """The per_sample rules of one ``attach`` call. ``expected_batch_size``: the divisor
    under Poisson sampling (else the examples counted this step); ``generator``: the
    noise's; ``reduce``: called on the clipped sums (after this rank's noise) before the
    division, e.g. an all-reduce; ``draws_noise``: False on ranks that add none
    (``set_up`` sets the three from the loop's facts).
    The layers are set up at the model's first training forward, from its trace.

    Under DDP flat clipping knows its factors only after the whole backward: no DDP
    all-reduce (``ddp_may_reduce``), ``reduce`` sums the ranks' clipped sums after rank 0
    alone added noise, the loop averages the rest (``manual_mean``); micro-batch losses
    stay undivided (``divides_step``)."""

    name = "per_sample"
    ddp_may_reduce = False
    divides_step = True

    @classmethod
    def check(cls, model: nn.Module, targets: list) -> None:
        super().check(model, targets)
        check_targets(model, targets)

    def __init__(self, model: nn.Module, targets: list, core: Core):
        loss_reduction = core.loss_reduction
        if loss_reduction not in LOSS_REDUCTIONS:
            raise ValueError(f"loss_reduction={loss_reduction!r}; allowed: {', '.join(LOSS_REDUCTIONS)}")
        rules = per_sample_rules(targets, dict(model.named_parameters()))
        self.model, self.rules, self.loss_reduction = model, rules, loss_reduction
        self.expected_batch_size: float | None = None
        self.generator: torch.Generator | None = None
        self.reduce: Callable[[list[Tensor]], None] | None = None
        self.draws_noise = True
        self._plain: list[nn.Parameter] | None = None  # outside every clipping rule (manual_mean)
        self.examples = 0  # examples whose clipped gradients are in the sums of this step
        self._rule_of = {id(p): r for r in rules for p in r.params}
        self._names = {id(p): n for n, p in model.named_parameters() if id(p) in self._rule_of}
        self._sums: dict[int, Tensor] = {}  # id(param) -> clipped sum of this step
        self._calls: list[Call] = []
        self._got: dict[int, Tensor | None] = {}  # parameters autograd gave a gradient in this backward
        self._batch_dependent: set[int] = set()  # whose batch gradient is no sum of per-example ones
        self._grad_eps = 0.0  # the coarsest rounding of the output gradients seen (bf16 under autocast)
        self._verify = True  # the first backward checks the followed calls against autograd
        self._queued = self._tracing = False
        self.layers: list[Layer] | None = None  # set up at the first training forward
        self._handles = [model.register_forward_pre_hook(self._first_forward, with_kwargs=True)]

    def _first_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self.layers is not None or self._tracing or not followed_forward() or self._swapped():
            return
        self._tracing = True
        try:
            found = trace(module, args, kwargs, set(self._rule_of))
        finally:
            self._tracing = False
        if found is None:
            raise ValueError(
                f"per_sample: {type(module).__name__}'s forward got no tensor with a batch dimension "
                f"(dim {batch_dim(module)}); the stage needs the batch in the model's inputs"
            )
        params = {n: p for n, p in self.model.named_parameters() if id(p) in self._rule_of and p.requires_grad}
        self.layers = assign(self.model, found, params)
        self._refuse(self.layers)
        self._batch_dependent = {
            id(p) for layer in self.layers if batch_dependent(layer.module) for p in layer.names.values()
        }
        self._handles += [
            layer.module.register_forward_hook(self._forward_hook(layer), with_kwargs=True) for layer in self.layers
        ]
        # after the trace: a lazy module's parameters exist only once a forward ran
        self._handles += [p.register_hook(self._arrived(p)) for p in params.values()]

    def _swapped(self) -> bool:
        """torch.func.functional_call runs the model with other tensors: not its training."""
        return any(param_or_none(self.model, n) is not p for p in self._rule_of_params() for n in [self._names[id(p)]])

    def _rule_of_params(self) -> list[Tensor]:
        return [p for r in self.rules for p in r.params]

    def _refuse(self, layers: list[Layer]) -> None:
        names = {id(m): n for n, m in self.model.named_modules()}
        for layer in layers:
            why = layer.form.refusal(layer.module)
            if why:
                p = self._names[id(next(iter(layer.names.values())))]
                raise ValueError(
                    f"per_sample: {p!r} is in {names.get(id(layer.module)) or 'the model'} "
                    f"({type(layer.module).__name__}), whose per-example gradient the stage cannot "
                    f"give with {why}; change the layer or leave its parameters out of the rule"
                )

    def _arrived(self, p: Tensor):
        """A hook on the parameter: its whole gradient of this backward, from every use.
        The first backward keeps it, to check that the calls followed add up to it."""

        def hook(g: Tensor) -> None:
            self._got[id(p)] = g if self._verify else None
            self._queue()

        return hook

    def _queue(self) -> None:
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    @property
    def noisy(self) -> PerSampleClip | None:
        """The rule that adds noise (at most one): its ``max_norm`` and ``noise_multiplier``."""
        return next((r.clip for r in self.rules if r.clip and r.clip.noise_multiplier > 0), None)

    def _forward_hook(self, layer: Layer):
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if self._tracing or not followed_forward():
                return
            outs = [t for t in pytree.tree_leaves(output) if isinstance(t, Tensor)]
            if not any(t.requires_grad for t in outs):
                return
            dtype = next(iter(layer.names.values())).dtype  # autocast: computed in the parameters' dtype
            if layer.form.whole_call:
                a, k = pytree.tree_map(lambda x: detach_input(x, dtype), (args, kwargs))
                inputs = Inputs(a, k, layer.in_dims)
            else:  # a closed form's one input, however it was passed, batch first
                first = next(x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, Tensor))
                inputs = detach_input(first, dtype).movedim(layer.first_in, 0)
            call = Call(
                layer,
                inputs,
                [(t.shape, dtype if t.is_floating_point() else t.dtype, t.device) for t in outs],
                [None] * len(outs),
            )
            self._calls.append(call)
            for k, t in enumerate(outs):
                if t.requires_grad:
                    t.register_hook(self._grad_hook(call, k))

        return hook

    def _grad_hook(self, call: Call, k: int):
        def hook(g: Tensor) -> None:
            dtype = next(iter(call.layer.names.values())).dtype
            if g.is_floating_point():  # autocast's bf16 gradients round more: the sum check allows for it
                self._grad_eps = max(self._grad_eps, torch.finfo(g.dtype).eps)
            call.grads[k] = g.detach() if g.dtype == dtype or not g.is_floating_point() else g.detach().to(dtype)
            self._queue()

        return hook

    def _end_backward(self) -> None:
        """Clip this backward's per-example gradients into the step's sums."""
        calls = [c for c in self._calls if any(g is not None for g in c.grads)]
        self._calls, self._queued = [], False  # calls without gradients were not in this backward
        got, self._got = self._got, {}
        self._check_covered(calls, got)
        if not calls:
            return
        bsz = self._clip(calls, got if self._verify else None)
        self._verify = False
        for r in self.rules:  # the batch gradient autograd accumulated is replaced by the sums
            if r.clip is not None:
                for p in r.params:
                    p.grad = None
        self.examples += bsz

    def _check_covered(self, calls: list[Call], got: dict[int, Tensor | None]) -> None:
        """Every parameter autograd gave a gradient came through a call the stage follows."""
        covered = {id(p) for c in calls for p in c.layer.names.values()}
        missing = [i for i in got if i not in covered]
        if not missing:
            return
        name = self._names[missing[0]]
        if self.layers is None:
            raise ValueError(
                f"per_sample: {name!r} got a gradient before the attached model's first training "
                "forward set the stage up; call the model you attached (not one of its parts)"
            )
        raise ValueError(
            f"per_sample: {name!r} got a gradient from outside every module call the stage follows "
            "(used outside the model's forward, e.g. in the loss, or in a way its first forward did "
            "not); its per-example gradient is unknown, so it is neither clipped nor kept"
        )

    def _check_sums(self, ghost, full, got: dict[int, Tensor | None], like: Tensor) -> None:
        """The followed calls' gradients add up to autograd's: no use of a parameter escaped them."""
        ones = {r.name: torch.ones_like(like) for r in self.rules}
        summed = self._weighted(ghost, full, ones)
        scale = max((float(g.norm()) for g in got.values() if g is not None), default=0.0)
        for p, g in summed.items():
            whole = got.get(id(p))
            if whole is None or id(p) in self._batch_dependent:
                continue
            # rounding: relative to this gradient, or to the largest where this one is ~0 exactly
            eps = max(torch.finfo(g.dtype).eps, self._grad_eps)
            tol = (10 if eps > 1e-4 else 1e3) * eps * max(float(whole.norm()), 1e-3 * scale) + 1e-30
            if float((g - whole).norm()) > tol:
                raise ValueError(
                    f"per_sample: {self._names[id(p)]!r} got part of its gradient outside the module "
                    "calls the stage follows (used outside the model's forward, e.g. in the loss); "
                    "that part has no per-example split, so the parameter cannot be clipped"
                )

    def _clip(self, calls: list[Call], got: dict[int, Tensor | None] | None = None) -> int:
        b0 = self._grads(calls[0])
        bsz = b0[0][0].shape[b0[0][1]] if calls[0].layer.form.whole_call else b0.shape[0]
        scale = float(bsz) if self.loss_reduction == "mean" else 1.0  # per-example = scale * what b gives
        dtype = torch.promote_types(calls[0].shapes[0][1], torch.float32)  # norms in float32 or better
        norms2 = {r.name: torch.zeros(bsz, dtype=dtype, device=calls[0].shapes[0][2]) for r in self.rules}
        ghost, full = self._norms(calls, norms2)
        norms = {r: v.sqrt() * scale for r, v in norms2.items()}
        clip = {
            r.name: (r.clip.max_norm / (norms[r.name] + EPS)).clamp(max=1.0) * scale
            for r in self.rules
            if r.clip is not None
        }
        if got is not None:
            self._check_sums(ghost, full, got, next(iter(norms.values())))
        for p, g in self._weighted(ghost, full, clip).items():
            self._sums[id(p)] = g if id(p) not in self._sums else self._sums[id(p)] + g
        self._record(ghost, full, norms, scale)
        return bsz

    def _norms(self, calls: list[Call], norms2: dict[str, Tensor]) -> tuple[list, dict[nn.Parameter, Tensor]]:
        """Add each call's squared per-example norms to its rules' ``norms2``. Returns the
        calls whose layer answers without per-example tensors (with their output
        gradients), and the per-example tensors of the others, summed per parameter."""
        seen: dict[int, int] = {}
        for c in calls:
            seen[id(c.layer)] = seen.get(id(c.layer), 0) + 1
        ghost, full = [], {}
        norms2_dtype = next(iter(norms2.values())).dtype
        for c in calls:
            b, form, names = self._grads(c), c.layer.form, set(c.layer.names)
            if c.layer.materialise or seen[id(c.layer)] > 1 or form.materialises(c.layer.module, c.inputs, b):
                for n, g in form.per_example(c.layer.module, c.inputs, b, names).items():
                    p = c.layer.names[n]
                    full[p] = g if p not in full else full[p] + g
            else:
                for n, v in form.norms2(c.layer.module, c.inputs, b, names).items():
                    norms2[self._rule_of[id(c.layer.names[n])].name] += v.to(norms2_dtype)
                ghost.append((c, b))
        for p, g in full.items():
            norms2[self._rule_of[id(p)].name] += as_rows(g).to(norms2_dtype).square().sum(1)
        return ghost, full

    def _record(self, ghost, full, norms: dict[str, Tensor], scale: float) -> None:
        """The rules' statistics of this backward; ``log`` needs the mean gradient too."""
        logs = {
            r.name: torch.full_like(norms[r.name], scale / norms[r.name].numel())
            for r in self.rules
            if r.log is not None
        }
        means = self._weighted(ghost, full, logs) if logs else {}
        for r in self.rules:
            if r.clip is not None:
                r.clip.record.add_norms(norms[r.name], r.clip.max_norm)
            if r.log is not None:
                sq = sum(means[p].to(norms[r.name].dtype).square().sum() for p in r.params if p in means)
                r.log.add_norms(norms[r.name], norms[r.name].new_tensor(0.0) + sq)

    def _weighted(self, ghost, full, weights: dict[str, Tensor]) -> dict[nn.Parameter, Tensor]:
        """``sum_i w_i g_i`` for each parameter of the rules in ``weights`` (rule -> [B])."""
        out: dict[nn.Parameter, Tensor] = {}
        for c, b in ghost:
            by_rule: dict[str, set[str]] = {}
            for n, p in c.layer.names.items():
                by_rule.setdefault(self._rule_of[id(p)].name, set()).add(n)
            for rule, names in by_rule.items():
                if rule in weights:
                    for n, g in c.layer.form.weighted(c.layer.module, c.inputs, b, weights[rule], names).items():
                        out[c.layer.names[n]] = g.to(c.layer.names[n].dtype)
        for p, g in full.items():
            rule = self._rule_of[id(p)].name
            if rule in weights:
                out[p] = torch.tensordot(weights[rule].to(g.dtype), g, 1).to(p.dtype)
        return out

    def _grads(self, c: Call):
        """The output gradient(s) of a call (outputs that got none count as zeros): for a
        whole-call form (gradient, batch dim) pairs, else the first, batch first."""
        grads = [
            g if g is not None else torch.zeros(s, dtype=dt, device=dev) for g, (s, dt, dev) in zip(c.grads, c.shapes)
        ]
        if c.layer.form.whole_call:
            return list(zip(grads, c.layer.out_dims))
        return grads[0].movedim(c.layer.out_dims[0], 0)

    def finish(self) -> None:
        """Once per optimizer step: each clipping rule's params get ``(sum + noise) / n``."""
        if self.layers is None:
            stray = next(
                (
                    n
                    for r in self.rules
                    if r.clip
                    for p in r.params
                    if p.grad is not None
                    for n in [self._names.get(id(p))]
                ),
                None,
            )
            if stray is not None:
                raise ValueError(
                    f"per_sample: {stray!r} got a gradient, but the attached model never ran a training "
                    "forward to set the stage up; call the model you attached (not one of its parts)"
                )
        if not self.examples and self.expected_batch_size is None:
            return  # nothing seen; under Poisson sampling an empty step still gets its noise
        n = float(self.expected_batch_size or self.examples)
        for r in self.rules:
            if r.clip is None:
                continue
            sums = [self._sums.pop(id(p), None) for p in r.params]
            sums = [torch.zeros_like(p) if s is None else s for p, s in zip(r.params, sums)]
            std = r.clip.noise_multiplier * r.clip.max_norm
            if std > 0 and self.draws_noise:
                for s in sums:
                    s.add_(torch.randn(s.shape, generator=self.generator, device=s.device, dtype=s.dtype), alpha=std)
            if self.reduce is not None:
                self.reduce(sums)
            for p, s in zip(r.params, sums):
                p.grad = s.div_(n)
        self._sums.clear()
        self.examples = 0

    def set_up(self, loop: Loop) -> None:
        """The divisor (Poisson: the expected global batch; else the examples counted, times
        the ranks), noise on the main rank only, the ranks' clipped sums summed."""
        world = loop.world_size
        divide = 1.0 if loop.poisson else float(world)  # Poisson: the divisor is already global
        self.expected_batch_size = float(loop.step_examples or 0) * world if loop.poisson else None
        reduce = loop.all_reduce_sum
        self.reduce = (lambda sums: reduce(sums, divide)) if world > 1 and reduce is not None else None
        self.draws_noise = loop.is_main

    def manual_mean(self) -> list[nn.Parameter]:
        """Outside every clipping rule: DDP's meaning, the mean of the ranks' local gradients."""
        if self._plain is None:
            clipped = {id(p) for r in self.rules if r.clip is not None for p in r.params}
            self._plain = [p for p in self.model.parameters() if p.requires_grad and id(p) not in clipped]
        return self._plain

    def records(self) -> list[tuple[str, Any]]:
        """(statistics key, window) of each rule's ``per_sample_clip`` and ``log``."""
        clips = [(f"{r.name}/per_sample_clip", r.clip.record if r.clip else None) for r in self.rules]
        logs = [(f"{r.name}/log", r.log) for r in self.rules]
        return [kv for pair in zip(clips, logs) for kv in pair if kv[1] is not None]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._calls, self._sums, self.examples = [], {}, 0
