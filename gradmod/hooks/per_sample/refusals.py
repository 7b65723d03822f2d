"""What the model's first training forward shows the per_sample stage cannot split per
example, each refused in one line when it sets the stage up (the rules and the model before
anything is attached: ``sample_rules``). A refusal names the parameter or module and what to
change; a per-example gradient the stage cannot know is never replaced by something else.
"""

from __future__ import annotations

from torch import nn

from gradmod.hooks.per_sample.assign import Layer
from gradmod.hooks.per_sample.forms.replay import FuncForm
from gradmod.hooks.trace.first_forward import Trace


def _path(model: nn.Module, m: nn.Module) -> str:
    return next((n for n, x in model.named_modules() if x is m), "") or type(model).__name__


def refuse_packed(model: nn.Module, trace: Trace, layers: list[Layer]) -> None:
    """A PackedSequence merges the examples' steps into one dimension: only an RNN's own form
    splits it (``Form.takes_packed``). Every parameter of a rule under a module that gets or
    gives one must be such an RNN's, or one line names the module."""
    splits = {id(p) for layer in layers if layer.form.takes_packed for p in layer.names.values()}
    ruled = {id(p) for layer in layers for p in layer.names.values()}
    for m in trace.packed:
        if all(id(p) in splits for p in m.parameters() if id(p) in ruled):
            continue
        where = f"{type(m).__name__}, the attached model," if m is model else f"{_path(model, m)} ({type(m).__name__})"
        raise ValueError(
            f"per_sample: {where} gets or gives a PackedSequence, whose packed steps the stage can split per "
            "example only inside torch's nn.RNN, nn.LSTM or nn.GRU; pack and unpack around those, feed the "
            "other layers padded tensors (nn.utils.rnn.pad_packed_sequence), or leave their parameters out "
            "of the rule"
        )


def refuse_positions(model: nn.Module, trace: Trace, dim: int) -> None:
    """Outputs that do not grow with the declared batch: whatever grew was not the examples.
    (A model that returns only scalars, its loss, says nothing either way.)"""
    dims = trace.dims.get(id(model))
    if not isinstance(dims, tuple) or any(d is not None for d in dims[1]) or all(len(s) == 0 for s in trace.outs):
        return
    raise ValueError(
        f"per_sample: {type(model).__name__}'s outputs do not grow with dim {dim} of its inputs, so that "
        "dim is not the examples' (each position's gradient would be clipped, not each example's); "
        "declare the inputs' batch dimension with attach(batch_dim=...) (or the model's batch_first)"
    )


def refuse_forms(model: nn.Module, layers: list[Layer], names: dict[int, str]) -> None:
    """A closed form's own refusal (``Form.refusal``) of its layer's configuration."""
    for layer in layers:
        why = layer.form.refusal(layer.module)
        if why:
            p = names[id(next(iter(layer.names.values())))]
            raise ValueError(
                f"per_sample: {p!r} is in {_path(model, layer.module)} ({type(layer.module).__name__}), "
                f"whose per-example gradient the stage cannot give with {why}; change the layer or leave "
                "its parameters out of the rule"
            )


def _dropout_keys(stack: tuple[nn.Module, ...], p: float) -> str:
    """The model config's dropout keys (Hugging Face: ``model.config``) with probability ``p``."""
    for m in reversed(stack):
        config = getattr(m, "config", None)
        if config is not None and hasattr(config, "to_dict"):
            found = {k: v for k, v in config.to_dict().items() if "drop" in k and isinstance(v, float) and v > 0}
            keys = [k for k, v in found.items() if abs(v - p) < 1e-12] or list(found)
            if keys:
                return f"set {' and '.join(f'config.{k}' for k in sorted(keys))} to 0.0"
    return "give it dropout 0.0 (nn.TransformerEncoderLayer(dropout=0.0), nn.MultiheadAttention(dropout=0.0)) or .eval() it"


def refuse_random(model: nn.Module, layers: list[Layer], trace: Trace, names: dict[int, str]) -> None:
    """The general path replays a module per example with ``torch.func``, which cannot see the
    masks the batch's forward drew: dropout inside such a module is refused."""
    for layer in layers:
        if not isinstance(layer.form, FuncForm):
            continue
        for op, p, stack in trace.random:
            if any(m is layer.module for m in stack):
                inner = stack[-1]
                param = names[id(next(iter(layer.names.values())))]
                raise ValueError(
                    f"per_sample: {param!r} takes the general path through {_path(model, layer.module)} "
                    f"({type(layer.module).__name__}), which replays it per example without the batch's "
                    f"dropout masks, and {_path(model, inner)} ({type(inner).__name__}) runs {op} there "
                    f"(p={p:g}); {_dropout_keys(stack, p)}, or leave the parameter out of the rule"
                )


def refuse_untraced(rules: list, names: dict[int, str]) -> None:
    """A clipped parameter got a gradient, yet the attached model never ran a training forward."""
    stray = next((names.get(id(p)) for r in rules if r.clip for p in r.params if p.grad is not None), None)
    if stray is not None:
        raise ValueError(
            f"per_sample: {stray!r} got a gradient, but the attached model never ran a training "
            "forward to set the stage up; call the model you attached (not one of its parts)"
        )


def refuse_own_gradient(rules: list, where: str, model: nn.Module, layer: nn.Module | None = None) -> None:
    """A gradient the loss takes of itself and differentiates again (``torch.autograd.grad(...,
    create_graph=True)``: a gradient penalty) runs through ``where``, which a rule follows: the
    penalty's gradient reaches the weights through their use in that backward too, which no layer
    input times output gradient gives, so no example's gradient can be formed (nor clipped, noised,
    scored). Refused as the penalty is taken, before the step's backward. ``layer``: where an
    input-gradient penalty's part is formed (``second_order``), the layer of a form that gives none."""
    keys = " and ".join(f"hooks.{r.name}" for r in rules)
    if layer is not None:
        raise ValueError(
            f"per_sample: the input-gradient penalty's backward runs through module {_path(model, layer)!r} "
            f"({type(layer).__name__}; parameters {where}), whose per-example form has no part for a gradient "
            f"taken through it (Linear, Conv and Conv1D layers do); leave its parameters out of {keys}, or "
            "penalize the input of a module after it"
        )
    raise ValueError(
        f"per_sample: the loss takes a gradient of itself through {where} (torch.autograd.grad with "
        f"create_graph=True: a gradient penalty), which {keys} cannot split per example: the penalty's gradient "
        "reaches the weights through that backward, not as a layer input times an output gradient; take the "
        "penalty outside the rule's layers, use the input_grad_penalty rule for a penalty on an input, or train "
        "without the per_sample rule"
    )
