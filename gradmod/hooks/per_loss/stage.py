"""The per_loss stage: several named losses in, one update per rule out.

``HookSet.backward(losses)`` hands the stage k scalar losses. For each rule whose method
needs the task gradients:

1. One batched backward (``is_grads_batched``: the k rows of the identity as output
   gradients) to the *outputs* of the rule's Linear and Conv layers (and to the rule's
   other parameters directly): the layers' k output gradients ``b_i``, never their k
   weight gradients.
2. The Gramian ``G_ij = <g_i, g_j>`` over all the rule's tensors together, per layer from
   the saved input ``a`` and the ``b_i``: either ``b_i^T (a a^T) b_j`` (the Gram of the
   rows, when the rows are fewer than the features) or the task gradients ``b_i^T a`` of
   that layer alone, whichever costs fewer flops.
3. Weights from the Gramian (host, float64), then the update ``sum_i w_i g_i`` per layer as
   one matmul ``(sum_i w_i b_i)^T a``, added to ``.grad``.

Every parameter outside the gradient rules gets the gradient of the sum of the losses (a
loss-weighting rule's parameters: of ``sum_i w_i L_i``), in one more backward restricted
to them. A ``modules:`` rule aggregates the task gradients of the module's output (the
representation) and hands the aggregate to the rest of the backward through a tensor
hook on that output: k cheap passes through the heads, one through the trunk.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.graph import get_gradient_edge

from gradmod.hooks.per_loss import gramian
from gradmod.hooks.per_loss.loss_rules import LossRule, check_targets, per_loss_rules
from gradmod.hooks.per_loss.record import TaskRecord
from gradmod.hooks.stage import Core, Loop, Stage


class PerLossStage(Stage):
    """The per_loss rules of one ``attach`` call; ``generator`` draws every random choice
    (PCGrad's order, ``random``, ``graddrop``, ``gradvac``).

    ``reduce``: set under data parallelism to a function that averages a list of tensors
    across ranks in place (an all-reduce). The stage then reduces what the global batch's
    update needs, so every rank gets the same weights: for ``params`` rules the task
    gradients themselves (k x D per step, formed per layer), for ``modules`` rules the
    k x k Gramian of the output's task gradients (the examples of different ranks are
    different rows of the representation's Jacobian, so the global Gramian is the mean of
    the local ones over the number of ranks), for loss weightings the k loss values.

    Under DDP its backward passes run under ``no_sync`` (DDP's bucketed all-reduce cannot
    follow them); the loop averages the gradients it leaves local (``manual_mean``: every
    parameter outside a gradient method's ``params`` rule) before ``after_backward``."""

    name = "per_loss"
    ddp_may_reduce = False
    on_sharded = "per_loss rules do not run on FSDP-sharded or tensor-parallel parameters yet; use DDP or one process"

    def __init__(self, model: nn.Module, targets: list, core: Core):
        self.rules = per_loss_rules(targets, dict(model.named_parameters()), dict(model.named_modules()))
        self._core = core
        self.reduce = None
        self.generator = torch.Generator().manual_seed(torch.initial_seed())
        self.inside = False  # True while the stage runs its own backward passes
        self._trainable = [p for p in model.parameters() if p.requires_grad]
        self.layers: list[gramian.Layer] = []
        self.direct: dict[int, tuple[LossRule, nn.Parameter]] = {}  # the rule's params outside a Layer
        self._outputs: dict[int, list] = {}  # id(module rule's module) -> gradient edges of its outputs
        self._handles = []
        self._setup(model)

    # ---- set-up: which parameters are answered from (a, b), which directly ----

    def _setup(self, model: nn.Module) -> None:
        owner = {id(p): r for r in self.rules if r.method.kind != "losses" for p in r.params}
        holders: dict[int, int] = {}
        for _, m in model.named_modules():
            for _, p in m.named_parameters(recurse=False):
                holders[id(p)] = holders.get(id(p), 0) + 1
        for _, m in model.named_modules():
            mine = {n: p for n, p in m.named_parameters(recurse=False) if id(p) in owner}
            if not mine:
                continue
            rules = {id(owner[id(p)]) for p in mine.values()}
            factored = (
                isinstance(m, (nn.Linear, *gramian.CONVS))
                and len(rules) == 1
                and all(holders[id(p)] == 1 for p in mine.values())
            )
            if factored:
                layer = gramian.Layer(m, owner[id(next(iter(mine.values())))], set(mine))
                self.layers.append(layer)
                self._handles.append(m.register_forward_hook(self._save(layer)))
            else:
                for p in mine.values():
                    self.direct[id(p)] = (owner[id(p)], p)
        for r in self.rules:
            for m in r.modules:
                self._outputs[id(m)] = []
                self._handles.append(m.register_forward_hook(self._save_output(m)))

    @staticmethod
    def _active(outs: list[Tensor]) -> bool:
        return (
            torch.is_grad_enabled()
            and not torch._C._are_functorch_transforms_active()
            and any(t.requires_grad for t in outs)
        )

    def _save(self, layer: gramian.Layer):
        def hook(module, args, output):
            if isinstance(output, Tensor) and self._active([output]):
                layer.calls.append((args[0].detach(), get_gradient_edge(output)))
                output.register_hook(self._guard(layer.rule))

        return hook

    def _save_output(self, m: nn.Module):
        def hook(module, args, output):
            outs = [t for t in (output if isinstance(output, (tuple, list)) else (output,)) if isinstance(t, Tensor)]
            if self._active(outs):
                self._outputs[id(m)].extend(t for t in outs if t.requires_grad)

        return hook

    def _guard(self, rule: LossRule):
        def hook(g):
            if not self.inside:
                raise RuntimeError(
                    f"hooks.{rule.name}: a per_loss rule needs its losses through "
                    "hooks.backward(losses), not loss.backward()"
                )

        return hook

    @classmethod
    def check(cls, model: nn.Module, targets: list) -> None:
        super().check(model, targets)
        check_targets(targets)

    @property
    def grad_scale(self) -> Tensor | None:
        """GradScaler's scale (fp16): the weights see unscaled gradients."""
        return self._core.grad_scale

    def set_up(self, loop: Loop) -> None:
        """Under DDP: ``reduce`` averages over the ranks, so every rank forms the global update."""
        reduce = loop.all_reduce_sum
        if loop.world_size > 1 and reduce is not None:
            world = float(loop.world_size)
            self.reduce = lambda tensors: reduce(tensors, world)

    def manual_mean(self) -> list[nn.Parameter]:
        """Every parameter but a gradient method's ``params`` rule's: its update is formed
        from the reduced task gradients."""
        whole = {id(p) for r in self.rules if r.method.kind != "losses" for p in r.params}
        return [p for p in self._trainable if id(p) not in whole]

    # ---- one backward ----

    def backward(self, losses: Tensor | Mapping[str, Tensor], closure=None) -> bool:
        """The step's backward of several named losses: each rule's combination of their
        gradients, every other parameter the gradient of their sum."""
        if isinstance(losses, Tensor):
            raise ValueError(
                f"hooks.{self.rules[0].name}: a per_loss rule combines the gradients of several losses, but "
                "hooks.backward got one scalar; give a mapping of named losses (or a sequence)"
            )
        if len(losses) < 2:
            raise ValueError(
                f"hooks.{self.rules[0].name}: a per_loss rule combines the gradients of several "
                f"losses, but hooks.backward got one ({', '.join(map(str, losses))}); give two or more"
            )
        names = list(losses)
        L = torch.stack([losses[n] for n in names])
        try:
            self.inside = True
            self._backward(names, L)
        finally:
            self.inside = False
            for layer in self.layers:
                layer.calls = []
            for k in self._outputs:
                self._outputs[k] = []
        return True

    def _backward(self, names: list[str], L: Tensor) -> None:
        k = len(names)
        grad_rules = [r for r in self.rules if r.method.kind != "losses"]
        inputs, slots = self._inputs(grad_rules)
        grads = self._task_grads(L, inputs, all(s[1] == "output" for s in slots)) if inputs else []
        replace: dict[int, Tensor] = {}  # id(module rule output) -> aggregated gradient
        for r in grad_rules:
            self._apply(r, names, [(s, g) for s, g in zip(slots, grads) if s[0] is r], replace, k)
        self._rest(names, L, replace, grad_rules)

    def _inputs(self, rules: list[LossRule]) -> tuple[list, list]:
        """What the batched backward differentiates to, and (rule, what, object) per entry."""
        inputs, slots = [], []
        for layer in self.layers:
            for a, edge in layer.calls:
                inputs.append(edge)
                slots.append((layer.rule, "layer", (layer, a)))
        for rule, p in self.direct.values():
            inputs.append(p)
            slots.append((rule, "param", p))
        for r in rules:
            for m in r.modules:
                for t in self._outputs[id(m)]:
                    inputs.append(get_gradient_edge(t))
                    slots.append((r, "output", t))
        return inputs, slots

    def _task_grads(self, L: Tensor, inputs: list, outputs_only: bool) -> list[Tensor | None]:
        """``[k, *input]`` per input: the k losses' gradients. Down to shared layers, one
        batched backward (big matmuls); down to a module's output only (the heads), k plain
        backward passes: each loss then goes through its own head alone, where the batched
        pass would send k rows, k - 1 of them zeros, through every head."""
        if not outputs_only:
            eye = torch.eye(len(L), dtype=L.dtype, device=L.device)
            return list(
                torch.autograd.grad(
                    L,
                    inputs,
                    grad_outputs=eye,
                    is_grads_batched=True,
                    retain_graph=True,
                    allow_unused=True,
                    materialize_grads=False,
                )
            )
        rows = [torch.autograd.grad(L[i], inputs, retain_graph=True, allow_unused=True) for i in range(len(L))]
        out = []
        for j in range(len(inputs)):
            got = [r[j] for r in rows]
            if all(g is None for g in got):
                out.append(None)
                continue
            like = next(g for g in got if g is not None)
            out.append(torch.stack([torch.zeros_like(like) if g is None else g for g in got]))
        return out

    def _apply(self, r: LossRule, names: list[str], parts: list, replace: dict, k: int) -> None:
        """Gramian, weights and the rule's update, from its entries of the batched backward."""
        entries = gramian.entries([(s, g) for s, g in parts if g is not None])
        if not entries:
            return
        if r.method.kind == "jacobian" or (self.reduce is not None and r.params):
            self._jacobian_rule(r, names, entries, replace)
            return
        G = sum(gramian.gram(e) for e in entries)
        if self.reduce is not None:  # modules rule: each rank's rows of the global Jacobian are 1/R of its own
            G = G.detach().clone()
            self.reduce([G])
            G = G / self.reduce_size()
        Gh = self._unscaled(G.detach().to("cpu", torch.float64), 2)
        w = r.method.weights(Gh, self.generator)
        r.record.add(names, Gh, w)
        wd = w.to(device=G.device)
        for e in entries:
            gramian.update(e, wd, replace)

    def _unscaled(self, t: Tensor, power: int) -> Tensor:
        """``t`` without GradScaler's factor (the Gramian has it squared, the losses once)."""
        if self.grad_scale is None:
            return t
        return t / float(self.grad_scale) ** power

    def reduce_size(self) -> int:
        """The number of ranks ``reduce`` averages over."""
        dist = torch.distributed
        return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1

    def _jacobian_rule(self, r: LossRule, names: list[str], entries: list, replace: dict) -> None:
        """The task gradients themselves, one [k, D] matrix: for a method that needs them, and
        under ``reduce`` (averaged across ranks, then the Gramian of the global batch)."""
        pieces = [piece for e in entries for piece in gramian.pieces(e)]  # (kind, tensor, [k, numel])
        pieces.sort(key=lambda x: self._position((x[0], x[1])))
        J = torch.cat([g for _, _, g in pieces], 1)
        if self.reduce is not None and r.params:
            J = J.detach().clone()
            self.reduce([J])
        Gh = self._unscaled((J @ J.T).detach().to("cpu", torch.float64), 2)
        if r.method.kind == "jacobian":
            U = torch.rand(J.shape[1], generator=self.generator, dtype=J.dtype).to(J.device)
            out = r.method.aggregate(J, U)
            r.record.add(names, Gh, None)
        else:
            w = r.method.weights(Gh, self.generator)
            r.record.add(names, Gh, w)
            out = torch.tensordot(w.to(J.device, J.dtype), J, 1)
        at = 0
        for what, obj, g in pieces:
            piece = out[at : at + g.shape[1]].view_as(obj)
            at += g.shape[1]
            if what == "param":
                gramian.add_grad(obj, piece)
            else:
                replace[id(obj)] = (obj, piece)

    def _position(self, target: tuple[str, Any]) -> int:
        """Parameters in model order (the order of the Jacobian's columns)."""
        what, obj = target
        if what != "param":
            return len(self._trainable)
        return next(i for i, p in enumerate(self._trainable) if p is obj)

    def _rest(self, names: list[str], L: Tensor, replace: dict, grad_rules: list[LossRule]) -> None:
        """The parameters outside the gradient rules: the gradient of the sum of the losses
        (of a loss weighting's weighted sum for its rule's parameters), the module rules'
        aggregates handed on through their outputs."""
        covered = {id(p) for r in grad_rules for p in r.params}
        weighted = [r for r in self.rules if r.method.kind == "losses"]
        groups: list[tuple[Tensor, list[nn.Parameter]]] = []
        values = L.detach().clone()
        if weighted and self.reduce is not None:  # the weights from the global batch's losses
            self.reduce([values])
        for r in weighted:
            w = r.method.loss_weights(self._unscaled(values.cpu(), 1), self.generator)
            r.record.add(names, None, w)
            groups.append(((w.to(L.device, L.dtype) * L).sum(), r.params))
            covered.update(id(p) for p in r.params)
        rest = [p for p in self._trainable if id(p) not in covered]
        if rest:
            groups.append((L.sum(), rest))
        handles = [t.register_hook(lambda _g, agg=agg: agg) for t, agg in replace.values()]
        try:
            if len(groups) == 1 and len(groups[0][1]) == len(self._trainable):
                groups[0][0].backward()  # everything from one loss: no restriction needed
            else:
                for i, (loss, params) in enumerate(groups):
                    loss.backward(inputs=params, retain_graph=i < len(groups) - 1)
        finally:
            for h in handles:
                h.remove()

    # ---- statistics and state ----

    def records(self) -> list[tuple[str, TaskRecord]]:
        return [(r.key, r.record) for r in self.rules]

    def end_epoch(self) -> None:
        for r in self.rules:
            r.method.end_epoch()

    def state_dict(self) -> dict[str, Any]:
        """The methods' state and the generator of their random choices."""
        methods = {r.key: r.method.state_dict() for r in self.rules}
        return {"per_loss": {"generator": self.generator.get_state(), "methods": methods}}

    def load_state_dict(self, state: Mapping[str, Any], device: Any = None) -> None:
        if "per_loss" not in state:
            return
        state = state["per_loss"]
        self.generator.set_state(state["generator"])
        for r in self.rules:
            if r.key in state.get("methods", {}):
                r.method.load_state_dict(state["methods"][r.key])

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for layer in self.layers:
            layer.calls = []
