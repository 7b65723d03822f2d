"""The per_loss stage: several named losses in, one update per rule out.

``HookSet.backward(losses)`` hands the stage k scalar losses; its ``backward`` reads as the
step's phases:

1. The task gradients (``task_grads``): for each rule whose method needs them, the k
   losses' gradients to the rule's entries (``entries``): its parameters and, for a Linear
   whose rows are few against its features, its *output* instead (that layer's k output
   gradients ``b_i``, never its k weight gradients). In one batched backward
   (``is_grads_batched``: the k rows of the identity as output gradients) where such
   Linears hold most of the parameters and no convolution is among them, else in k
   ordinary passes (``task_grads.batch_pays``).
2. Apply (``combine``): the Gramian ``G_ij = <g_i, g_j>`` over all the rule's entries
   together (such a Linear's part ``b_i^T (a a^T) b_j`` from its saved input ``a``), the
   method's weights from it (host, float64), then the update ``sum_i w_i g_i`` added to
   ``.grad``: one matmul ``(sum_i w_i b_i)^T a`` for such a Linear. An aggregator gets the
   task gradients themselves.
3. The rest (``rest``): every other parameter gets the gradient of the sum of the losses
   in one more backward; a ``modules:`` rule's aggregate of its output's task gradients
   goes on down that backward through a tensor hook on the output. Where a lone
   ``modules:`` rule's output is reached by each loss through a head of its own, the k
   gradients are caught from the heads in that one backward instead (``rest.one_pass``).

The forward hooks save what these phases read (``saved``). Self-attention given one tensor
as query, key and value projects the three apart (``in_projection``): the same values,
without the zero buffers a packed projection's backward fills per task.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from gradmod.hooks import stages
from gradmod.hooks.per_loss import loss_rules
from gradmod.hooks.per_loss.backward import Backward
from gradmod.hooks.per_loss.combine import combine
from gradmod.hooks.per_loss.entries import Layer, Replace
from gradmod.hooks.per_loss.in_projection import split_in_projections
from gradmod.hooks.per_loss.loss_rules import check_targets, per_loss_rules
from gradmod.hooks.per_loss.methods.bases import LossWeighting
from gradmod.hooks.per_loss.reach import head_edges
from gradmod.hooks.per_loss.record import TaskRecord
from gradmod.hooks.per_loss.rest import one_pass, rest_backward
from gradmod.hooks.per_loss.saved import Saved, refuse_sparse
from gradmod.hooks.per_loss.task_grads import batch_pays, gather, task_grads
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
        # The rules whose method needs the task gradients, and the loss weightings.
        self.grad_rules = [r for r in self.rules if not isinstance(r.method, LossWeighting)]
        self.weightings = [r for r in self.rules if isinstance(r.method, LossWeighting)]
        self._core = core
        self.model = model
        self.reduce = None
        self.generator = torch.Generator().manual_seed(torch.initial_seed())
        # One batched backward for the k losses; False: k backward passes (set by the first
        # batched pass a torch.compile'd backward refuses: its kernels do not run batched).
        self.batched = True
        # The parameters that train, read again at each backward: training may freeze or
        # unfreeze layers after attach, and each backward follows requires_grad as a plain one
        # (from the list: a walk of the model's modules costs 50 us a step on an MLP).
        self._params = list(model.parameters())
        self.trainable = [p for p in self._params if p.requires_grad]
        self._convolutions = {
            id(p)
            for m in model.modules()
            if isinstance(m, nn.modules.conv._ConvNd)
            for p in m.parameters(recurse=False)
        }
        refuse_sparse(model, self.grad_rules)
        weighting = [r.name for r in self.rules if r.method.weighs_rest]
        if len(weighting) > 1:
            raise ValueError(
                f"hooks.{weighting[1]}: only one per_loss rule may weight the losses of the parameters "
                f"outside the rules (heads: weighted), and hooks.{weighting[0]} does"
            )
        self.saved = Saved(model, self.rules, self.grad_rules, core.fills_grad)
        self._handles = split_in_projections(model, set(self.saved.owner)) if self.saved.owner else []
        self.tasks: list[str] | None = None  # the losses' names at the first backward, in order
        self._told: list[str] | None = None  # the names the methods last got (Method.set_tasks)

    @property
    def layers(self) -> list[Layer]:
        """The Linears answered from their rows (assigned by the first training forward)."""
        return self.saved.layers

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
        return not all(isinstance(s.fn, LossWeighting) for s in target.steps)

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
        return [p for p in self.trainable if id(p) not in self.saved.owner]

    # ---- one backward: the task gradients, apply, the rest ----

    def backward(self, losses: Tensor | Mapping[str, Tensor], closure=None) -> bool:
        """The step's backward of several named losses: each rule's combination of their
        gradients, every other parameter the gradient of their sum."""
        names = self._tasks(self._named(losses))
        self.trainable = [p for p in self._params if p.requires_grad]
        call = Backward(
            names=names,
            losses=[losses[n] for n in names],
            trainable=self.trainable,
            outputs=self.saved.outputs,
            generator=self.generator,
            reduce=self.reduce,
            grad_scale=self.grad_scale,
            autocast=self.saved.autocast,
        )
        try:
            self.saved.inside = True
            self._phases(call)
        except RuntimeError as e:
            if "use_reentrant=True" not in str(e):
                raise
            raise ValueError(
                f"hooks.{self.rules[0].name}: a per_loss rule takes gradients of some tensors only "
                "(torch.autograd.grad, backward(inputs=...)), which torch.utils.checkpoint refuses with "
                "use_reentrant=True; checkpoint with use_reentrant=False"
            ) from e
        finally:
            self.saved.inside = False
            self.saved.clear()
        return True

    def _phases(self, call: Backward) -> None:
        """The task gradients of the gradient rules' entries, each rule's update from them
        (apply), then the rest's backward; or, for a lone ``modules:`` rule whose output each
        loss reaches through a head of its own, the one pass that catches them."""
        self.saved.check_ran(self.rules)
        lone = self._lone_output()
        edges = None if lone is None else head_edges(call.losses, lone)
        if lone is not None and edges is not None:
            one_pass(call, self.rules[0], lone, edges)
            return
        replace: Replace = {}  # id(module rule output) -> (it, its aggregated gradient)
        inputs, entries = gather(call.losses, self.saved, self.grad_rules) if self.grad_rules else ([], [])
        if inputs:  # (loss weightings alone take no task gradient)
            # 1. The task gradients: one batched backward where it pays, else k passes.
            batch = self.batched and batch_pays(entries, self._convolutions)
            grads, ran_batched = task_grads(call.losses, inputs, batched=batch, frontier=self.saved.frontier_outputs())
            if batch:  # a backward that cannot run batched (torch.compile's kernels) turns it off for good
                self.batched = ran_batched
            # 2. Apply: each rule's update from its entries' task gradients.
            taken = [e for e in entries if e.take(grads)]
            for r in self.grad_rules:
                replace.update(combine(call, r, [e for e in taken if e.rule is r]))
        # 3. The rest: every other parameter's gradient of the (weighted) sum, in one backward.
        rest_backward(call, self.weightings, self.grad_rules, replace)

    def _named(self, losses: Tensor | Mapping[str, Tensor]) -> list[str]:
        """The losses' names; one scalar, or one loss, is refused in one line."""
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
        return list(losses)

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

    def _lone_output(self) -> Tensor | None:
        """The one output of a lone ``modules:`` rule, whose task gradients the rest's backward
        may catch from the heads (``rest.one_pass``): not under ``reduce`` (the Gramian's
        all-reduce would run inside the backward), nor for nash_mtl's weighted heads (they
        need the weights before the backward)."""
        if len(self.rules) != 1 or self.reduce is not None:
            return None
        r = self.rules[0]
        if not r.modules or r.method.weighs_rest:
            return None
        outs = [t for m in r.modules for t in self.saved.outputs[id(m)]]
        return outs[0] if len(outs) == 1 else None

    @property
    def wants_step_losses(self) -> bool:
        """A method learns from the step's batch's losses after the step (famo's same_batch)."""
        return any(r.method.wants_after_step for r in self.rules)

    def after_step(self, losses: Mapping[str, Tensor]) -> None:
        """The same batch's losses after ``optimizer.step()``, computed without gradients, for
        the methods that learn from them (famo): under ``reduce`` averaged over the ranks."""
        names = self._tasks(list(losses))
        values = torch.stack([losses[n].detach() for n in names]).clone()
        if self.reduce is not None:
            self.reduce([values])
        host = values.cpu()  # as the losses the weights came from (rest)
        for r in self.rules:
            if r.method.wants_after_step:
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
        self.saved.remove()
