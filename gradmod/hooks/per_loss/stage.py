"""The per_loss stage: several named losses in, one update per rule out.

``HookSet.backward(losses)`` hands the stage k scalar losses. For each rule whose method
needs the task gradients:

1. The k losses' gradients to the rule's parameters, and, for a Linear whose rows are few
   against its features, to its *output* instead: that layer's k output gradients ``b_i``,
   never its k weight gradients. In one batched backward (``is_grads_batched``: the k rows
   of the identity as output gradients) where such Linears hold most of the parameters and
   no convolution is among them, else in k ordinary passes (``task_grads.batch_pays``).
2. The Gramian ``G_ij = <g_i, g_j>`` over all the rule's tensors together: such a Linear's
   part ``b_i^T (a a^T) b_j`` from its saved input ``a`` (the Gram of the rows), every other
   tensor's from its k task gradients.
3. Weights from the Gramian (host, float64), then the update ``sum_i w_i g_i``: one matmul
   ``(sum_i w_i b_i)^T a`` for such a Linear, a weighted sum of the k task gradients for the
   rest, added to ``.grad``.

Self-attention given one tensor as query, key and value projects the three apart (the
``in_projection`` module): the same values, without the zero buffers a packed projection's
backward fills per task.

Every other parameter gets the gradient of the sum of the losses in one more backward
(``rest``). A ``modules:`` rule aggregates the task gradients of the module's output (the
representation) and hands the aggregate to the rest of the backward through a tensor
hook on that output: the k gradients caught from the heads in that one backward where each
loss has a head of its own (``_one_pass``), else k cheap passes through the heads first. A
loss weighting on a ``modules:`` rule weights the caught gradients in the same way.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.graph import get_gradient_edge
from torch.utils import _pytree as pytree

from gradmod.hooks import stages
from gradmod.hooks.per_loss import gramian, loss_rules
from gradmod.hooks.per_loss.frontier import frontier_module
from gradmod.hooks.per_loss.in_projection import split_in_projections
from gradmod.hooks.per_loss.loss_rules import LossRule, check_targets, per_loss_rules
from gradmod.hooks.per_loss.owners import head_edges
from gradmod.hooks.per_loss.record import TaskRecord
from gradmod.hooks.per_loss.rest import loss_weights, rest_backward
from gradmod.hooks.per_loss.task_grads import assign_layers, batch_pays, refuse_sparse, task_grads, used_apart
from gradmod.hooks.stage import Core, Loop, Stage
from gradmod.hooks.tracing import param_uses


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
        self.model = model
        rules = self.rules
        self.reduce = None
        self.generator = torch.Generator().manual_seed(torch.initial_seed())
        self.inside = False  # True while the stage runs its own backward passes
        # One batched backward for the k losses; False: k backward passes (set by the first
        # batched pass a torch.compile'd backward refuses: its kernels do not run batched).
        self.batched = True
        # The parameters that train, read again at each backward: training may freeze or
        # unfreeze layers after attach, and each backward follows requires_grad as a plain one
        # (from the list: a walk of the model's modules costs 50 us a step on an MLP).
        self._params = list(model.parameters())
        self.trainable = [p for p in self._params if p.requires_grad]
        self._owner = {id(p): r for r in rules if r.method.kind != "losses" for p in r.params}
        self._convolutions = {
            id(p)
            for m in model.modules()
            if isinstance(m, nn.modules.conv._ConvNd)
            for p in m.parameters(recurse=False)
        }
        refuse_sparse(model, self._owner)
        weighting = [r.name for r in rules if getattr(r.method, "heads", "sum") == "weighted"]
        if len(weighting) > 1:
            raise ValueError(
                f"hooks.{weighting[1]}: only one per_loss rule may weight the losses of the parameters "
                f"outside the rules (heads: weighted), and hooks.{weighting[0]} does"
            )
        self.layers: list[gramian.Layer] = []
        # Until the first training forward is traced, every parameter is answered directly.
        self.direct: dict[int, tuple[LossRule, nn.Parameter]] = {
            id(p): (r, p) for r in rules if r.method.kind != "losses" for p in r.params
        }
        self.outputs: dict[int, list] = {}  # id(module) -> its outputs' tensors: a module rule's, the frontier's
        self.model_outputs: list = []  # the model's outputs' nodes: the trace saw what lies below them
        self._handles = []
        self._traced = self._tracing = False
        self.tasks: list[str] | None = None  # the losses' names at the first backward, in order
        self._told: list[str] | None = None  # the names the methods last got (Method.set_tasks)
        if self._owner:
            self._handles.append(model.register_forward_pre_hook(self._first_forward, with_kwargs=True))
            self._handles.append(model.register_forward_hook(self._save_model_output))
            self._handles += split_in_projections(model, set(self._owner))
        # The outputs of the smallest module holding every gradient rule's tensors: the batched
        # backward starts there when every path runs through them (``frontier``).
        modules = [m for r in rules for m in r.modules]
        shared = (
            None
            if modules
            else frontier_module(model, [p for r in rules if r.method.kind != "losses" for p in r.params])
        )
        self._frontier = None if shared is None else id(shared)
        for m in modules + ([] if shared is None else [shared]):
            self.outputs[id(m)] = []
            self._handles.append(m.register_forward_hook(self._save_output(m)))

    # ---- set-up: which parameters are answered from (a, b), which directly ----

    def _first_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """The first training forward is traced once: a Linear may be answered from its
        (input, output gradient) pairs only when every use of its weight and bias ran inside
        its own forward (not attention's ``out_proj`` inside ``F.multi_head_attention_forward``,
        not a weight also used through ``F.linear`` or tied to another module)."""
        if self._traced or self._tracing or not self._active_forward():
            return
        self._tracing = True
        try:
            uses = param_uses(module, args, kwargs, set(self._owner))
        finally:
            self._tracing = False
        self._traced = True
        self._assign(uses)

    def _assign(self, uses: dict[int, list]) -> None:
        for layer in assign_layers(self.model, self._owner, uses):
            self.layers.append(layer)
            self._handles.append(layer.module.register_forward_hook(self._save(layer)))
            for p in layer.module.parameters(recurse=False):
                self.direct.pop(id(p), None)

    @staticmethod
    def _active_forward() -> bool:
        return torch.is_grad_enabled() and not torch._C._are_functorch_transforms_active()

    @staticmethod
    def _active(outs: list[Tensor]) -> bool:
        return (
            torch.is_grad_enabled()
            and not torch._C._are_functorch_transforms_active()
            and any(t.requires_grad for t in outs)
        )

    def _save(self, layer: gramian.Layer):
        def hook(module, args, output):
            if isinstance(output, Tensor) and not self._tracing and self._active([output]):
                layer.calls.append((args[0].detach(), get_gradient_edge(output)))
                output.register_hook(self._guard(layer.rule))

        return hook

    def _save_model_output(self, module, args, output):
        outs = [t for t in pytree.tree_leaves(output) if isinstance(t, Tensor)]
        if not self._tracing and self._active(outs):
            self.model_outputs += [t.grad_fn for t in outs if t.grad_fn is not None]

    def _save_output(self, m: nn.Module):
        def hook(module, args, output):
            if torch.compiler.is_compiling():
                # Compiled with what follows, the output would be one more output of a node
                # that also makes the losses' heads: the losses never reach it, so its task
                # gradients could not be caught (a loss weighting then did nothing). It ends a graph.
                torch._dynamo.graph_break()
            outs = [t for t in pytree.tree_leaves(output) if isinstance(t, Tensor)]  # an LSTM's (h, c) too
            if not self._tracing and self._active(outs):
                self.outputs[id(m)].extend(t for t in outs if t.requires_grad)

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

    @classmethod
    def check_rule(cls, rule: str, kind: str, names: list[str], spec: Mapping[str, Any]) -> None:
        loss_rules.check_rule(rule, kind, names, spec, dict(stages.get(cls.name).rule_keys)["rows"])

    @classmethod
    def several_passes(cls, targets: list) -> tuple[Any, str] | None:
        return loss_rules.several_passes(targets)

    in_backward_instead = ", a loss weighting or a modules: rule"

    @classmethod
    def after_backward(cls, target: Any) -> bool:
        """A loss weighting scales its parameters' gradient as it arrives; a method of the
        task gradients writes ``.grad`` after the backward."""
        return not all(getattr(s.fn, "kind", None) == "losses" for s in target.steps)

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
        return [p for p in self.trainable if id(p) not in whole]

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
        names = self._tasks(list(losses))
        listed = [losses[n] for n in names]
        self.trainable = [p for p in self._params if p.requires_grad]
        try:
            self.inside = True
            self._backward(names, listed)
        except RuntimeError as e:
            if "use_reentrant=True" not in str(e):
                raise
            raise ValueError(
                f"hooks.{self.rules[0].name}: a per_loss rule takes gradients of some tensors only "
                "(torch.autograd.grad, backward(inputs=...)), which torch.utils.checkpoint refuses with "
                "use_reentrant=True; checkpoint with use_reentrant=False"
            ) from e
        finally:
            self.inside = False
            for layer in self.layers:
                layer.calls = []
            for k in self.outputs:
                self.outputs[k] = []
            self.model_outputs = []
        return True

    def _tasks(self, names: list[str]) -> list[str]:
        """The tasks in the order of the first backward (a method's state is by position);
        another set of tasks is refused by a method that keeps a state per task. The methods
        are told the names whenever they change (``Method.set_tasks``)."""
        if self.tasks is None:
            self.tasks = names
        if names == self.tasks or set(names) == set(self.tasks):
            names = self.tasks
        else:
            for r in self.rules:
                if r.method.per_task_state:
                    raise ValueError(
                        f"hooks.{r.name}: per_loss method {r.method_name!r} keeps a state per task and got the "
                        f"losses {', '.join(names)} after {', '.join(self.tasks)}; every backward must bring "
                        "the same named losses (a stateless method, such as upgrad or mean, takes any)"
                    )
        if names != self._told:  # the methods learn the names whenever they change
            self._told = names
            for r in self.rules:
                try:
                    r.method.set_tasks(names)
                except ValueError as e:
                    raise ValueError(f"hooks.{r.name}: {e}") from None
        return names

    def _backward(self, names: list[str], listed: list[Tensor]) -> None:
        for r in self.rules:
            if r.modules and not any(self.outputs[id(m)] for m in r.modules):
                raise ValueError(
                    f"hooks.{r.name}: no module of this modules rule ran in a training forward (gradients "
                    "on) before this backward, so there is no output whose task gradients to combine"
                )
        if self._one_pass(names, listed):
            return
        k = len(names)
        grad_rules = [r for r in self.rules if r.method.kind != "losses"]
        replace: dict[int, tuple[Tensor, Tensor]] = {}  # id(module rule output) -> (it, its aggregated gradient)
        if grad_rules:  # (loss weightings alone take no task gradient)
            inputs, slots = self._inputs(grad_rules, listed)
            grads = self._task_grads(listed, inputs, slots) if inputs else []
            for r in grad_rules:
                self._apply(r, names, [(s, g) for s, g in zip(slots, grads) if s[0] is r], replace, k)
        rest_backward(self, names, listed, replace, grad_rules)

    def _one_pass(self, names: list[str], listed: list[Tensor]) -> bool:
        """A lone ``modules:`` rule whose one output each loss reaches through a head of its
        own (``owners.head_edges``): each head's gradient of the output is caught as the head
        hands it on in the one backward of the sum, and the rule's aggregate (a loss
        weighting's: ``sum_i w_i g_i``) replaces their sum there. No pass through the heads
        per task or for the weighted sum; the same gradients."""
        if len(self.rules) != 1 or self.reduce is not None:
            return False  # under reduce, the Gramian's all-reduce would run inside the backward
        r = self.rules[0]
        if not r.modules or getattr(r.method, "heads", "sum") == "weighted":
            return False  # (nash_mtl's weighted heads need the weights before the backward)
        outs = [t for m in r.modules for t in self.outputs[id(m)]]
        if len(outs) != 1:
            return False
        out = outs[0]
        edges = head_edges(listed, out)
        if edges is None:
            return False
        L = torch.stack(listed) if r.method.kind == "losses" else None  # a loss weighting's: weights, backward
        weights = None if L is None else loss_weights(self, r, names, L)
        caught: list[Tensor | None] = [None] * len(listed)

        def catch(i: int, at: list[int]):
            def hook(grad_inputs, grad_outputs):
                for j in at:
                    if grad_inputs[j] is not None:
                        caught[i] = grad_inputs[j] if caught[i] is None else caught[i] + grad_inputs[j]

            return hook

        def combine(total: Tensor) -> Tensor | None:
            if weights is not None:
                acc = None
                for w, g in zip(weights, caught):
                    if g is not None:
                        acc = g * w if acc is None else acc.add_(g, alpha=w)
                return acc
            D = torch.stack([torch.zeros_like(total) if g is None else g for g in caught])
            replace: dict[int, tuple[Tensor, Tensor]] = {}
            self._apply(r, names, [((r, "output", out), D)], replace, len(listed))
            return replace[id(out)][1] if id(out) in replace else None

        handles = [node.register_hook(catch(i, at)) for i, mine in enumerate(edges) for node, at in mine]
        handles.append(out.register_hook(combine))
        try:
            if L is None:
                rest_backward(self, names, listed, {}, [r])
            else:  # every parameter but through the output: the plain sum's gradient
                torch.autograd.backward(L.sum())
        finally:
            for h in handles:
                h.remove()
        return True

    def _inputs(self, rules: list[LossRule], losses: list[Tensor]) -> tuple[list, list]:
        """What the batched backward differentiates to, and (rule, what, object) per entry."""
        inputs, slots = [], []
        rows = [layer for layer in self.layers if layer.calls and layer.rows_pay(len(losses))]
        # A weight the losses also use apart from its layer's outputs: its own task gradients.
        by_rows = {id(layer) for layer in rows} - (used_apart(losses, rows, self.model_outputs) if rows else set())
        for layer in self.layers:
            live = sorted(n for n in layer.names if getattr(layer.module, n).requires_grad)  # frozen: no gradient
            if len(live) == len(layer.names) and id(layer) in by_rows:
                for a, edge in layer.calls:
                    inputs.append(edge)
                    slots.append((layer.rule, "layer", (layer, a)))
            elif layer.calls:  # its k task gradients from the backward itself
                for n in live:
                    p = getattr(layer.module, n)
                    inputs.append(p)
                    slots.append((layer.rule, "param", p))
        for rule, p in self.direct.values():
            if p.requires_grad:
                inputs.append(p)
                slots.append((rule, "param", p))
        for r in rules:
            for m in r.modules:
                for t in self.outputs[id(m)]:
                    inputs.append(get_gradient_edge(t))
                    slots.append((r, "output", t))
        return inputs, slots

    def _task_grads(self, losses: list[Tensor], inputs: list, slots: list) -> list[Tensor | None]:
        """``[k, *input]`` per input (``per_loss.task_grads``), from one batched backward where
        it pays (``batch_pays``), else k passes; a backward that cannot run batched
        (torch.compile's kernels) turns ``batched`` off for good."""
        batch = self.batched and batch_pays(slots, self._convolutions)
        grads, ran_batched = task_grads(losses, inputs, batched=batch, frontier=self.outputs.get(self._frontier, []))
        if batch:
            self.batched = ran_batched
        return grads

    def _apply(self, r: LossRule, names: list[str], parts: list, replace: dict, k: int) -> None:
        """Gramian, weights and the rule's update, from its entries of the batched backward."""
        entries = gramian.entries([(s, g) for s, g in parts if g is not None])
        if not entries:
            return
        if r.method.kind == "jacobian" or (self.reduce is not None and r.params):
            self._jacobian_rule(r, names, entries, replace)
            return
        if r.rows == "batch":  # LibMTL's rep_grad: each task's output gradient summed over the batch (dim 0)
            S = torch.cat([gramian.task_rows(e[2].sum(1) if e[2].dim() > 1 else e[2]) for e in entries], 1)
            if self.reduce is not None:  # the global batch's sums: the mean of the ranks' (each loss a mean)
                S = S.detach().clone()
                self.reduce([S])
            G = S @ S.T
        else:
            G = sum(gramian.gram(e) for e in entries)
        if (
            self.reduce is not None and r.rows != "batch"
        ):  # modules rule: each rank's rows of the global Jacobian are 1/R of its own
            G = G.detach().clone()
            self.reduce([G])
            G = G / self.reduce_size()
        Gh = self.unscaled(G.detach().to("cpu", torch.float64), 2)
        w = self._weights(r, names, Gh)
        wd = w.to(device=G.device)
        for e in entries:
            gramian.update(e, wd, replace)

    def _weights(self, r: LossRule, names: list[str], G: Tensor) -> Tensor:
        """The method's weights, recorded; a non-finite Gramian (a nan or inf in a task's
        loss or gradient) gives nan weights without asking the method, whose solver would
        fail and whose state would keep the nan: the update is nan, and the trainer's
        non-finite policy (``skip``, ``raise``) and its divergence check act on it as on
        any other step."""
        if not torch.isfinite(G).all():
            return torch.full((len(G),), math.nan, dtype=G.dtype)
        w = r.method.weights(G, self.generator)
        r.record.add(names, G, w)
        return w

    def unscaled(self, t: Tensor, power: int) -> Tensor:
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
        Gh = self.unscaled((J @ J.T).detach().to("cpu", torch.float64), 2)
        if r.method.kind == "jacobian":
            if r.rows == "batch":  # graddrop's form on a representation: per feature, over the batch
                out = torch.cat([self._per_feature(r, obj, g) for _, obj, g in pieces])
            else:
                U = torch.rand(J.shape[1], generator=self.generator, dtype=J.dtype).to(J.device)
                out = r.method.aggregate(J, U)
            if torch.isfinite(Gh).all():
                r.record.add(names, Gh, None)
        else:
            w = self._weights(r, names, Gh)
            out = torch.tensordot(w.to(J.device, J.dtype), J, 1)
        at = 0
        for what, obj, g in pieces:
            piece = out[at : at + g.shape[1]].view_as(obj)
            at += g.shape[1]
            if what == "param":
                gramian.add_grad(obj, piece)
            else:
                replace[id(obj)] = (obj, piece.to(obj.dtype))

    def _per_feature(self, r: LossRule, out: Tensor, g: Tensor) -> Tensor:
        """``aggregate_batch`` of a module output's ``[k, numel]`` task gradients: the batch
        its first dimension, one draw per feature."""
        D = g.view(len(g), out.shape[0] if out.dim() else 1, -1)
        U = torch.rand(D.shape[2], generator=self.generator, dtype=D.dtype).to(D.device)
        return r.method.aggregate_batch(D, out.detach().sign().reshape(D.shape[1:]), U).flatten()

    def _position(self, target: tuple[str, Any]) -> int:
        """Parameters in model order (the order of the Jacobian's columns)."""
        what, obj = target
        if what != "param":
            return len(self.trainable)
        return next(i for i, p in enumerate(self.trainable) if p is obj)

    @property
    def wants_step_losses(self) -> bool:
        """A method learns from the step's batch's losses after the step (famo's same_batch)."""
        return any(getattr(r.method, "wants_after_step", False) for r in self.rules)

    def after_step(self, losses: Mapping[str, Tensor]) -> None:
        """The same batch's losses after ``optimizer.step()``, computed without gradients, for
        the methods that learn from them (famo): under ``reduce`` averaged over the ranks."""
        names = self._tasks(list(losses))
        values = torch.stack([losses[n].detach() for n in names]).clone()
        if self.reduce is not None:
            self.reduce([values])
        host = values.cpu()  # as the losses the weights came from (_rest)
        for r in self.rules:
            if getattr(r.method, "wants_after_step", False):
                r.method.after_step(host)

    # ---- statistics and state ----

    def records(self) -> list[tuple[str, TaskRecord]]:
        return [(r.key, r.record) for r in self.rules]

    def end_epoch(self) -> None:
        for r in self.rules:
            r.method.end_epoch()

    def state_dict(self) -> dict[str, Any]:
        """The methods' state, the generator of their random choices and the tasks' order
        (a method's state is by position in it)."""
        methods = {r.key: r.method.state_dict() for r in self.rules}
        return {"per_loss": {"generator": self.generator.get_state(), "methods": methods, "tasks": self.tasks}}

    def load_state_dict(self, state: Mapping[str, Any], device: Any = None) -> None:
        if "per_loss" not in state:
            return
        state = state["per_loss"]
        self.generator.set_state(state["generator"])
        if state.get("tasks") is not None:  # the resumed run's losses are put back in this order
            self.tasks, self._told = list(state["tasks"]), None
        for r in self.rules:
            if r.key in state.get("methods", {}):
                r.method.load_state_dict(state["methods"][r.key])

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for layer in self.layers:
            layer.calls = []
