"""The form of any module: its per-example gradients by replaying it with ``torch.func``
(``vmap`` of its vjp), for the layers without a closed form in ``layers``."""

from __future__ import annotations

from typing import Any

from torch import Tensor
from torch.func import functional_call, grad, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils import _pytree as pytree

from gradmod.hooks.per_sample.forms.base import Form, Inputs


def _insert(x: Any, d: int | None) -> Any:
    return x.unsqueeze(d) if d is not None else x


class FuncForm(Form):
    """Any module: ``vmap`` over the batch of the gradient of ``sum_k <output_k(x_i), b_ik>``
    with respect to the parameters asked for (local, possibly dotted names: a module answers
    for its children's parameters where it uses them itself), by ``torch.func``."""

    whole_call = True

    def per_example(self, m, a: Inputs, b: list, names):
        grads = [g for g, _ in b]
        out_dims = [d for _, d in b]
        params = {n: m.get_parameter(n).detach() for n in names}

        def inner(p, args, kwargs, gs):
            args, kwargs = pytree.tree_map(_insert, (args, kwargs), a.dims)
            outs = [o for o in pytree.tree_leaves(functional_call(m, p, args, kwargs)) if isinstance(o, Tensor)]
            return sum((o * g.unsqueeze(d)).sum() for o, g, d in zip(outs, gs, out_dims))

        args_dims, kwargs_dims = a.dims
        try:  # attention in its math form: vmap batches it (the fused kernels it would loop over)
            with sdpa_kernel(SDPBackend.MATH):
                return vmap(grad(inner), in_dims=(None, args_dims, kwargs_dims, out_dims))(
                    params, a.args, a.kwargs, grads
                )
        except RuntimeError as e:  # what torch.func cannot batch (data-dependent control flow, .item())
            why = (str(e).strip().splitlines() or [""])[0]
            raise ValueError(
                f"per_sample: torch.func cannot replay {type(m).__name__} per example ({why}); give the layer "
                "a form (gradmod.register_form) or leave its parameters out of the rule"
            ) from None
