"""Each example's gradient of a loss that holds an input-gradient penalty (``input_grad_penalty``).

The penalty differentiates the loss by an input ``x`` inside the loss (``torch.autograd.grad(...,
create_graph=True)``), and the backward that fills ``.grad`` then runs through that first backward
too. Where the first backward crosses a layer whose output is bilinear in its weight and its input
(``y = a W^T + b``: Linear, Conv, Hugging Face's Conv1D), it forms ``g_a``, the gradient on the
layer's input, from the output gradient ``delta`` and ``W``; the final backward reaches ``W``
through it with ``d<gbar, g_a>/dW``, ``gbar`` the final backward's gradient on ``g_a``. That is the
layer's own weight gradient with ``gbar`` as its input and ``delta`` as its output gradient (the
op is linear in each). So example i's weight gradient is the layer form's at ``(a_i, ybar_i)``
plus the form's at ``(gbar_i, delta_i)``: a second call of the layer, for the weight alone (the
bias is not in ``g_a``). Nothing of example j reaches example i's terms in a model without batch
statistics (those the stage refuses), so each example's gradient stays its own.

A layer of any other form on that first backward's path is refused in one line as the penalty is
taken, before the step's backward."""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from gradmod.hooks.per_sample.assign import Call


def answers(call: Call) -> bool:
    """Whether ``call``'s layer gives its weight's part through the first backward (a bilinear form,
    called on the whole batch)."""
    layer = call.layer
    return layer.form.second_order and not layer.broadcast and not layer.form.whole_call


class SecondOrder:
    """One backward's output gradients ``delta`` (recorded in the loss's own backward) and input
    gradients' gradients ``gbar`` (in the final one) per followed call. ``fills``: whether the
    backward in progress fills ``.grad`` (the final one)."""

    def __init__(self, fills: Callable[[], bool]):
        self._fills = fills
        self._delta: dict[int, tuple[Call, Tensor]] = {}
        self._gbar: dict[int, Tensor] = {}

    def watch(self, call: Call, live: object) -> None:
        """At the call's forward: its input (the live tensor, not the stage's detached copy) hooked,
        to hook in turn the gradient the loss's own backward forms on it."""
        if answers(call) and isinstance(live, Tensor) and live.requires_grad:
            live.register_hook(self._input_grad(call))

    def _input_grad(self, call: Call) -> Callable[[Tensor], None]:
        def keep(gbar: Tensor) -> None:
            self._gbar[id(call)] = gbar.detach()

        def hook(g_a: Tensor) -> None:
            if not self._fills() and g_a.requires_grad:  # the loss's own backward, building a graph
                g_a.register_hook(keep)  # the sum over the input's uses: its gradient is each one's

        return hook

    def output_grad(self, call: Call, g: Tensor) -> bool:
        """``delta`` of the loss's own backward kept; False where the call cannot give its part."""
        if not answers(call):
            return False
        self._delta[id(call)] = (call, g.detach())
        return True

    def calls(self) -> list[Call]:
        """This backward's second calls, one per call whose input gradient the final backward
        reached (a penalty that does not reach it adds nothing there); then a fresh start."""
        out = []
        for key, (call, delta) in self._delta.items():
            gbar = self._gbar.get(key)
            if gbar is None:
                continue
            dtype = next(iter(call.layer.names.values())).dtype
            second = Call.of(call.layer, gbar.to(dtype).movedim(call.layer.first_in, 0), [delta])
            second.grads, second.only = [delta.to(dtype)], frozenset({"weight"})
            out.append(second)
        self._delta.clear()
        self._gbar.clear()
        return out
