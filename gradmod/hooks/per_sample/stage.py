"""The per_sample stage: each example's gradient, clipped, summed and noised (DP-SGD).

A forward hook on every module that holds a parameter of a per_sample rule keeps its input (detached)
and hooks its outputs for their gradients (attention records its projections'). Each backward ends in
its checks (``_check_arrivals``: every gradient came through a followed call; the sums against autograd's
at the first backward, along probe directions later), around ``_clip_and_accumulate``: per rule each
example's norm over all the rule's parameters (flat clipping, ``examples``), the factors
``min(1, C / (|g_i| + 1e-6))`` and ``sum_i c_i g_i`` (one weighted matmul per layer) into the step's sums,
in place of autograd's ``.grad``. ``finish()``, once a step: the noise (``N(0, (sigma C)^2)``), then the
division by the step's (expected) examples. Nothing per example outlives its backward but ``scores``.
An input-gradient penalty's part through the loss's own backward comes as calls too (``second_order``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence
from torch.utils import _pytree as pytree

from gradmod.hooks import registry as R
from gradmod.hooks import stages
from gradmod.hooks.per_sample import refusals
from gradmod.hooks.per_sample.accounts import Probed, check_covered, check_sums, refuse_arrivals
from gradmod.hooks.per_sample.assign import Call, Layer, assign, paths_of
from gradmod.hooks.per_sample.detached_weights import detach_during, detachable, formed_sums, hang
from gradmod.hooks.per_sample.examples import PerExampleSums, Seen
from gradmod.hooks.per_sample.forms import position_bias
from gradmod.hooks.per_sample.forms.attention import follow
from gradmod.hooks.per_sample.forms.base import Inputs
from gradmod.hooks.per_sample.forms.layers import batch_dependent
from gradmod.hooks.per_sample.sample_rules import check_options, check_rule, check_targets, per_sample_rules
from gradmod.hooks.per_sample.scores import KeepsScores, keeper, watch_outputs
from gradmod.hooks.per_sample.second_order import SecondOrder
from gradmod.hooks.per_sample.stats import PerSampleClip, buffers, record
from gradmod.hooks.per_sample.trainable import Trainable, all_trainable
from gradmod.hooks.stage import Core, Loop, Stage
from gradmod.hooks.trace.first_forward import (
    batch_dim,
    batch_size,
    broadcasts_alike,
    detach_input,
    expand_rows,
    followed_forward,
    is_packed,
    param_or_none,
)
from gradmod.hooks.trace.held import settle

__all__ = ["PerSampleStage", "per_sample_rules"]

EPS = 1e-6  # Opacus' guard against a zero norm in the clip factor


class PerSampleStage(KeepsScores, Stage):
    """The per_sample rules of one ``attach`` call. ``expected_batch_size``: the divisor under Poisson
    sampling (else the examples counted this step); ``generator``: the noise's; ``reduce``: called on the
    clipped sums (after this rank's noise) before the division, e.g. an all-reduce; ``draws_noise``: False
    on ranks that add none (``set_up`` sets the three from the loop's facts); ``batch_dim`` (``core``'s):
    the inputs' batch dimension (None: 0, or 1 for ``batch_first = False``). The layers are set up at the
    model's first training forward with a non-empty batch, from its trace.

    Under DDP flat clipping knows its factors only after the whole backward: no DDP all-reduce
    (``ddp_may_reduce``), ``reduce`` sums the ranks' clipped sums after rank 0 alone added noise, the
    loop averages the rest (``manual_mean``); where a rule clips, micro-batch losses stay undivided."""

    name = "per_sample"
    ddp_may_reduce = False

    @classmethod
    def check(cls, model: nn.Module, targets: list) -> None:
        super().check(model, targets)
        check_targets(model, targets)

    @classmethod
    def check_rule(cls, rule: str, kind: str, names: list[str], spec: Mapping[str, Any]) -> None:
        check_rule(rule, names, R.accepted_at(cls.name))

    def __init__(self, model: nn.Module, targets: list, core: Core):
        loss_reduction, batch_dim = core.loss_reduction, core.batch_dim
        check_options(loss_reduction, batch_dim)
        rules = per_sample_rules(targets, dict(model.named_parameters()))
        self.model, self.rules, self.loss_reduction, self.batch_dim = model, rules, loss_reduction, batch_dim
        self._fills = core.fills_grad  # the backward that fills .grad, not a gradient the loss takes of itself
        self.divides_step = any(r.clip is not None for r in rules)  # else autograd's mean stays, as in a plain loop
        self.expected_batch_size: float | None = None
        self.generator: torch.Generator | None = None
        self.reduce: Callable[[list[Tensor]], None] | None = None
        self.draws_noise = True
        self._plain: list[nn.Parameter] | None = None  # outside every clipping rule (manual_mean)
        self.examples = 0  # examples whose clipped gradients are in the sums of this step
        self._rule_of = {id(p): r for r in rules for p in r.params}
        self._clipped = {id(p) for r in rules if r.clip is not None for p in r.params}
        self._names = {id(p): n for n, p in model.named_parameters() if id(p) in self._rule_of}
        self._trainable = Trainable(model, rules)  # requires_grad, read at each training forward
        self._sums: dict[int, Tensor] = {}  # id(param) -> clipped sum of this step
        self._calls: list[Call] = []
        self._got: dict[int, Tensor | None] = {}  # parameters autograd gave a gradient in this backward
        self._batch_dependent: set[int] = set()  # whose batch gradient is no sum of per-example ones
        self._grad_eps = 0.0  # the coarsest rounding of the output gradients seen (bf16 under autocast)
        self._verify = True  # the first backward checks the followed calls against autograd
        self._probed = Probed()  # every later one along a random direction per parameter
        self._sums_of = PerExampleSums(self._rule_of, self._trainable, self._probed)
        self._queued = self._tracing = self._broadcast = self._empty = False  # _empty: a zero-example forward ran
        self._batch = 0  # this forward's batch size, where a one-row call is expanded to it
        self.layers: list[Layer] | None = None  # set up at the first training forward
        self.scores = keeper(rules)  # GraNd and EL2N by dataset index (``see_batch``, ``take_scores``)
        inputs = any(t.kind == "module" and stages.get(t.stage).differentiates_inputs for t in targets)
        self._second = SecondOrder(self._fills) if inputs else None  # an input-gradient penalty's part
        self._handles = [model.register_forward_pre_hook(self._first_forward, with_kwargs=True)]
        self._handles.append(model.register_forward_hook(self._forward_end))
        self._handles += watch_outputs(model, self.scores, self._following)

    def _read_trainable(self) -> None:
        """``requires_grad`` read again: where some parameter was frozen or unfrozen since the last
        read, nothing trains outside the noisy rule, and the next backward checks against autograd's whole."""
        if self._trainable.changed():
            self._trainable.refuse_outside()
            self._plain, self._verify = None, True

    def _forward_end(self, module: nn.Module, args: tuple, output: Any) -> None:
        """Read again at the forward's end: the model's ``forward`` may have (un)frozen a layer since."""
        if self.layers is not None and self._following():
            self._read_trainable()

    def _first_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not self._tracing and followed_forward():
            self._read_trainable()
        if self.layers is not None:
            if self._broadcast and followed_forward():  # the size one-row calls are expanded to
                self._batch = batch_size(module, args, kwargs, self.batch_dim) or 0
            return
        if self._tracing or not followed_forward() or self._swapped():
            return
        if batch_size(module, args, kwargs, self.batch_dim) == 0:
            self._empty = True  # nothing to trace; the step's gradients are zeros (plus noise)
            return
        self._tracing = True  # the stage's own forwards are no training forwards
        try:
            found, params, layers = self._layers(module, args, kwargs)
        finally:
            self._tracing = False
        self._broadcast, self._batch = any(layer.broadcast for layer in layers), found.batch
        refusals.refuse_positions(self.model, found, batch_dim(module, self.batch_dim))
        refusals.refuse_forms(self.model, layers, self._names)
        refusals.refuse_random(self.model, layers, found, self._names)
        self.layers = layers
        self._batch_dependent = {id(p) for x in self.layers if batch_dependent(x.module) for p in x.names.values()}
        self._detached = detachable(self.layers) & self._clipped
        shared = {id(p) for x in self.layers if x.materialise for p in x.names.values()}
        hangs = detachable(self.layers) - self._clipped - shared  # autograd's gradient kept: the calls give it
        hangs = hangs if self._second is None else set()  # (they would give no penalty's part)
        live = self._trainable  # (its live set is replaced when training freezes or unfreezes)
        ready = lambda: set() if self._verify or not self._following() else live.live  # noqa: E731
        detach = lambda: self._detached & ready()  # noqa: E731  (ready: what may run detached now)
        for x in self.layers:  # attention records its calls inside its forward; the others may run detached
            self._handles.append(x.module.register_forward_hook(self._forward_hook(x), with_kwargs=True))
            done = lambda a, o, x=x: self._follow(x, a, o)  # noqa: E731
            if x.form.captures:
                self._handles += follow(x.module, x.form, x.names, self._following, done, detach)
            elif any(id(p) in self._detached for p in x.names.values()):
                self._handles += detach_during(x.module, x.names, detach)
            elif all(id(p) in hangs for p in x.names.values()):
                hung = lambda x=x: ready() & {id(p) for p in x.names.values()}  # noqa: E731
                self._handles += detach_during(x.module, x.names, hung, lambda ps, x=x: setattr(x, "hung", ps))
        # after the trace: a lazy module's parameters exist only once a forward ran
        self._probed.set_up(list(params.values()))
        with all_trainable(params.values()):  # frozen ones too, for when they train
            self._handles += [p.register_hook(self._arrived(p)) for p in params.values()]

    def _layers(self, module: nn.Module, args: tuple, kwargs: dict):
        """The trace, the parameters it covers, the layers answering for them."""
        with all_trainable(p for r in self.rules for p in r.params):  # the uses of frozen ones too
            found, handles = position_bias.traced(module, args, kwargs, set(self._rule_of), self.batch_dim)
        settle(found.asked if found is not None else {})  # what the model's forward switched itself
        self._handles += handles
        if found is None:
            raise ValueError(
                f"per_sample: {type(module).__name__}'s forward got no tensor with a batch dimension "
                f"(dim {batch_dim(module, self.batch_dim)}); the stage needs the batch in the model's inputs"
            )
        params = {n: p for n, p in self.model.named_parameters() if id(p) in self._rule_of}
        layers = assign(self.model, found, params)
        refusals.refuse_packed(self.model, found, layers)
        rows = [(layer.module, layer.rows) for layer in layers if layer.broadcast]
        if rows and not broadcasts_alike(self.model, args, kwargs, rows, found):
            layers = assign(self.model, found, params, broadcast=False)  # the general path instead
        return found, params, layers

    def _swapped(self) -> bool:
        """torch.func.functional_call runs the model with other tensors: not its training."""
        return any(param_or_none(self.model, self._names[id(p)]) is not p for r in self.rules for p in r.params)

    def _arrived(self, p: Tensor):
        """The parameter's whole gradient of this backward, from every use: kept whole at the
        first backward, along the parameter's probe direction at every later one."""

        def hook(g: Tensor) -> None:
            if not self._fills():
                return self._own_gradient(p)
            self._got[id(p)] = g if self._verify else None
            if not self._verify:
                self._probed.arrived(p, g)
            self._queue()

        return hook

    def _own_gradient(self, at: Tensor | Layer) -> None:
        """Inside a gradient the loss takes of itself (``torch.autograd.grad``) nothing is recorded; one
        that builds a graph (a gradient penalty) through ``at`` (a rule's parameter or layer) is refused,
        but where an input-gradient penalty's part is formed (``second_order``)."""
        if torch.is_grad_enabled():
            names = ", ".join(repr(self._names[id(q)]) for q in (at.names.values() if isinstance(at, Layer) else [at]))
            layer = at.module if self._second is not None and isinstance(at, Layer) else None
            refusals.refuse_own_gradient(self.rules, names, self.model, layer)

    def _queue(self) -> None:
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    @property
    def noisy(self) -> PerSampleClip | None:
        """The rule that adds noise (at most one): its ``max_norm`` and ``noise_multiplier``."""
        return next((r.clip for r in self.rules if r.clip and r.clip.noise_multiplier > 0), None)

    def _following(self) -> bool:  # a training forward of the model, not one of the stage's own
        return not self._tracing and followed_forward()

    def _follow(self, layer: Layer, inputs: Any, outs: list[Tensor], hung: list[Tensor] | None = None) -> None:
        """A call of ``layer`` to clip at the end of the backward: its output gradients hooked,
        its output hung from the parameters in ``hung`` (run detached: ``detached_weights.hang``)."""
        self._calls.append(call := Call.of(layer, inputs, outs))
        if hung:
            self._probed.hung.update(id(p) for p in hung)
            gave = lambda q, g: self._probed.gave(q, g) if self._fills() else None  # noqa: E731
            hang(outs[0], hung, formed_sums(call, hung, gave))
        for k, t in enumerate(outs):
            if t.requires_grad:
                t.register_hook(self._grad_hook(call, k))

    def _forward_hook(self, layer: Layer):
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
            hung, layer.hung = layer.hung, []
            if not self._following() or layer.form.captures:
                return None
            if layer.broadcast:  # one row for the whole batch: each example's copy gets its own gradient
                output = expand_rows(output, layer.rows, self._batch)
            outs = [
                t.data if isinstance(t, PackedSequence) else t for t in pytree.tree_leaves(output, is_leaf=is_packed)
            ]
            outs = [t for t in outs if isinstance(t, Tensor)]
            if not hung and not any(t.requires_grad for t in outs):
                return output if layer.broadcast else None
            dtype = next(iter(layer.names.values())).dtype  # autocast: computed in the parameters' dtype
            if layer.form.whole_call:
                a, k = pytree.tree_map(lambda x: detach_input(x, dtype), (args, kwargs), is_leaf=is_packed)
                inputs = Inputs(a, k, layer.in_dims)
            else:  # a closed form's one input, however it was passed, batch first
                first = next(x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, Tensor))
                if layer.broadcast:
                    first = first.expand(self._batch, *first.shape[1:])
                inputs = detach_input(first, dtype).movedim(layer.first_in, 0)
            self._follow(layer, inputs, outs, hung)
            if self._second is not None and not layer.form.whole_call:
                self._second.watch(self._calls[-1], first)
            return output if layer.broadcast else None

        return hook

    def _grad_hook(self, call: Call, k: int):
        def hook(g: Tensor) -> None:
            if not self._fills():
                if torch.is_grad_enabled() and self._second is not None and self._second.output_grad(call, g):
                    return None
                return self._own_gradient(call.layer)
            dtype = next(iter(call.layer.names.values())).dtype
            if g.is_floating_point():  # autocast's bf16 gradients round more: the sum check allows for it
                self._grad_eps = max(self._grad_eps, torch.finfo(g.dtype).eps)
            call.grads[k] = g.detach() if g.dtype == dtype or not g.is_floating_point() else g.detach().to(dtype)
            self._queue()

        return hook

    def _end_backward(self) -> None:
        """Once per backward: every gradient accounted for, then each example's clipped into the step's sums."""
        calls = [c for c in self._calls if any(g is not None for g in c.grads) and self._trainable.names(c.layer)]
        if self._second is not None:  # each layer's part through the loss's own backward, a call of its own
            calls += [c for c in self._second.calls() if "weight" in self._trainable.names(c.layer)]
        self._calls, self._queued = [], False  # calls without gradients were not in this backward
        got, self._got = self._got, {}
        if self._verify:  # no probe check in this one: what hung calls gave is not kept for the next
            self._probed.forget_given()
        self._check_arrivals(calls, got)
        if not calls:
            return
        seen = self._sums_of.seen(calls, self.rules, self.loss_reduction, self._verify, self._detached)
        self._empty = self._empty or seen is None  # an empty batch: nothing to clip (the step may still add noise)
        if seen is not None:
            if self._verify:  # the first backward: against autograd's whole gradients
                check_sums(
                    self._sums_of.weighted(seen, seen.ones()), got, self._names, self._batch_dependent, self._grad_eps
                )
            self._clip_and_accumulate(seen, probe=not self._verify)
            if not self._verify:  # every later one: along each parameter's probe direction
                self._probed.check(self._names, self._batch_dependent, self._grad_eps)
            self._record(seen)
            self._verify = False
        for r in self.rules:  # the batch gradient autograd accumulated is replaced by the sums
            if r.clip is not None:
                for p in r.params:
                    p.grad = None
        self.examples += seen.batch if seen is not None else 0

    def _check_arrivals(self, calls: list[Call], got: dict[int, Tensor | None]) -> None:
        """Every gradient of a rule's parameter came through a call the stage follows."""
        covered = {id(p) for c in calls for p in self._trainable.names(c.layer).values()}
        check_covered(self._names, covered, got, self.layers is not None)
        refuse_arrivals(got, set() if self._verify else self._detached, self._names)

    def _clip_and_accumulate(self, seen: Seen, probe: bool) -> None:
        """``sum_i min(1, C / (|g_i| + eps)) g_i`` per clipping rule, added to the step's sums;
        ``probe``: the plain sums along the probe directions in the same pass."""
        clip = {
            r.name: (r.clip.max_norm / (seen.norms[r.name] + EPS)).clamp(max=1.0) * seen.scale
            for r in self.rules
            if r.clip is not None
        }
        for p, g in self._sums_of.weighted(seen, clip, probe).items():
            self._sums[id(p)] = g if id(p) not in self._sums else self._sums[id(p)] + g

    def _record(self, seen: Seen) -> None:
        """The rules' statistics of this backward; ``log`` needs the mean gradient too."""
        norms = seen.norms
        logs = {r.name: torch.full_like(norms[r.name], seen.scale / norms[r.name].numel()) for r in self.rules if r.log}
        record(self.rules, norms, self._sums_of.weighted(seen, logs) if logs else {})

    def finish(self) -> None:
        """Once per optimizer step, the DP step's phases (after its checks): each clipping rule's
        sums get their noise, are reduced over the ranks and scaled by the step's examples."""
        self._probed.settle()  # the step's probes agree
        if self.layers is None and not self._empty:  # a rule's parameters were traced
            refusals.refuse_untraced(self.rules, self._names)
        n = self._divisor()
        if n is None:
            return
        for r in self.rules:
            if r.clip is not None:
                params = [p for p in r.params if p.requires_grad]  # a frozen one keeps .grad = None
                sums = [self._sums.pop(id(p)) if id(p) in self._sums else torch.zeros_like(p) for p in params]
                if self.draws_noise:
                    r.clip.add_noise(sums, self.generator)
                if self.reduce is not None:
                    self.reduce(sums)
                for p, s in zip(params, sums):
                    p.grad = s.div_(n)
        self._sums.clear()
        self.examples = 0

    def _divisor(self) -> float | None:
        """The step's (expected) number of examples; None where none was seen and none is expected
        (each clipping rule's parameters then get zeros: no size to divide noise by)."""
        empty, self._empty = self._empty, False
        if not self.examples and self.expected_batch_size is None:
            for p in [p for r in self.rules if r.clip and empty for p in r.params if p.requires_grad]:
                p.grad = torch.zeros_like(p)
            return None
        return float(self.expected_batch_size or self.examples)

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
            self._plain = [p for p in self.model.parameters() if p.requires_grad and id(p) not in self._clipped]
        return self._plain

    def records(self) -> list[tuple[str, Any]]:
        return buffers(self.rules)

    def paths(self) -> dict[str, str]:
        """Each parameter's path (``assign.path_of``); {} before the first training forward."""
        return paths_of(self.model, self.layers or [], self._names)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._calls, self._sums, self.examples = [], {}, 0
