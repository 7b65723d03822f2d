"""Each example's own loss gradient over some parameters, as ``[B, numel]`` blocks, one per name.

Two ways to the same numbers. Where every selected parameter belongs to layers with a per-example
form (Linear, convolutions, HF ``Conv1D``, Embedding, the norms, BatchNorm in eval mode), one
batched forward records each call's input, one backward gives each call's output gradient, and the
form turns the pair into each example's gradient (``gradmod.hooks.per_sample.forms``: the products
Captum's sample-wise mode forms too). Else, and wherever that path does not give what
``torch.func.vmap`` of ``grad`` gives on a model's first batch (a weight also used outside its
layer, a layer that does not see the batch first), each example's gradient is that ``vmap``.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

from gradmod.hooks.per_sample.forms import layers
from gradmod.hooks.per_sample.forms.base import Form

log = logging.getLogger("gradmod.scores")

EVAL_BATCH_NORM = layers.EvalBatchNormForm()
Plan = dict[nn.Module, tuple[Form, dict[str, str]]]  # layer -> (its form, local name -> selected name)


def by_vmap(model: nn.Module, names: Sequence[str], x: Tensor, y: Tensor) -> list[Tensor]:
    """``torch.func``: ``vmap`` over the batch of ``grad`` of one example's cross-entropy."""
    params = {n: p.detach() for n, p in model.named_parameters()}
    buffers = {n: b.detach() for n, b in model.named_buffers()}
    rest = {n: p for n, p in params.items() if n not in names}

    def loss(own: dict[str, Tensor], xi: Tensor, yi: Tensor) -> Tensor:
        out = functional_call(model, ({**rest, **own}, buffers), (xi.unsqueeze(0),))
        return F.cross_entropy(out, yi.unsqueeze(0))

    g = vmap(grad(loss), in_dims=(None, 0, 0))({n: params[n] for n in names}, x, y)
    return [g[n].reshape(len(x), -1) for n in names]


def _form(m: nn.Module) -> Form | None:
    if isinstance(m, nn.modules.batchnorm._BatchNorm) and not m.training and m.running_mean is not None:
        return EVAL_BATCH_NORM
    form = layers.form_of(m)
    if form.whole_call or form.captures or form.refusal(m) is not None or layers.batch_dependent(m):
        return None
    return form


def plan(model: nn.Module, names: Sequence[str]) -> Plan | None:
    """Each layer holding a selected parameter, with its form; None where one has no form."""
    asked = set(names)
    wanted = {id(p): n for n, p in model.named_parameters() if n in asked}
    out: Plan = {}
    covered: set[str] = set()
    for m in model.modules():
        own = {local: wanted[id(p)] for local, p in m.named_parameters(recurse=False) if id(p) in wanted}
        if not own:
            continue
        form = _form(m)
        if form is None:
            return None
        out[m] = (form, own)
        covered |= set(own.values())
    return out if covered == asked else None


def by_forms(model: nn.Module, layer_plan: Plan, names: Sequence[str], x: Tensor, y: Tensor) -> list[Tensor] | None:
    """Each example's gradient from every call's input and output gradient (None: a call that
    does not see the batch first, or whose output gradient the backward did not reach)."""
    calls: list[tuple[nn.Module, Any]] = []  # each call's layer and input
    outputs: list[Any] = []
    grads: dict[int, Tensor] = {}  # call -> its output gradient (no reference back to the graph)

    def record(m: nn.Module, args: tuple, out: Any) -> None:
        k = len(calls)
        calls.append((m, args[0] if args else None))
        outputs.append(out)
        if isinstance(out, Tensor) and out.requires_grad:
            # on the output as the layer gave it: an in-place op after (ReLU) does not change what it gets
            out.register_hook(lambda g: grads.__setitem__(k, g))

    hooks = [m.register_forward_hook(record) for m in layer_plan]
    try:
        out = model(x)
    finally:
        for h in hooks:
            h.remove()
    bsz = len(x)
    if any(not isinstance(t, Tensor) or len(t) != bsz for call, o in zip(calls, outputs) for t in (call[1], o)):
        return None
    torch.autograd.grad(F.cross_entropy(out, y, reduction="sum"), outputs, allow_unused=True)
    sums: dict[str, Tensor] = {}
    for k, (m, a) in enumerate(calls):
        if k not in grads:
            return None
        form, own = layer_plan[m]
        for local, g in form.per_example(m, a.detach(), grads[k], set(own)).items():
            n = own[local]
            sums[n] = sums[n] + g if n in sums else g
    if set(sums) != set(names):
        return None
    return [sums[n].reshape(bsz, -1) for n in names]


def channels_last(model: nn.Module) -> bool:
    """Put a convolutional model on a CPU in channels-last layout, in place (whether it was):
    there its pooling and convolutions run two to three times faster; the numbers are the same."""
    weights = [p for p in model.parameters() if p.dim() == 4]
    if not weights or weights[0].device.type != "cpu":
        return False
    model.to(memory_format=torch.channels_last)
    return True


class ExampleGrads:
    """``self(x, y)``: each example's cross-entropy gradient over ``names`` of ``model`` (eval mode
    as the caller set it). The first batch is also taken by ``vmap``: if the forms' numbers differ
    from it, every batch after goes by ``vmap`` (logged once)."""

    def __init__(self, model: nn.Module, names: Sequence[str]):
        self.model, self.names = model, list(names)
        self._plan = plan(model, self.names)
        self._checked = False
        self._layout = any(
            p.dim() == 4 and p.is_contiguous(memory_format=torch.channels_last) and not p.is_contiguous()
            for p in model.parameters()
        )

    @property
    def by_forms(self) -> bool:
        return self._plan is not None

    def __call__(self, x: Tensor, y: Tensor) -> list[Tensor]:
        if self._layout and x.dim() == 4:  # images in the layout of the model's weights
            x = x.contiguous(memory_format=torch.channels_last)
        if self._plan is None:
            return self._by_vmap(x, y)
        formed = by_forms(self.model, self._plan, self.names, x, y)
        if not self._checked or formed is None:
            self._checked = True
            reference = self._by_vmap(x, y)
            if formed is None or not all(_close(f, r) for f, r in zip(formed, reference)):
                log.info("per-example gradients by torch.func: the layers' forms do not give them for this model")
                self._plan = None
                return reference
        return formed

    def _by_vmap(self, x: Tensor, y: Tensor) -> list[Tensor]:
        try:
            return by_vmap(self.model, self.names, x, y)
        except RuntimeError as e:  # torch's own words, in one line
            raise ValueError(
                f"each example's gradient of this model: torch.func.vmap cannot batch it ({str(e).splitlines()[0]}); "
                "influence takes models whose layers have per-example forms (Linear, convolutions, Embedding, "
                "the norms) or that vmap can batch"
            ) from None


def _close(a: Tensor, b: Tensor) -> bool:
    scale = float(b.abs().max()) if b.numel() else 0.0
    return torch.allclose(a, b.to(a.dtype), rtol=1e-3, atol=1e-5 * scale + 1e-12)
