"""The hook stage: ``Tensor.register_hook`` on each selected tensor.

1. ``check``: a tensor hook never fires on an FSDP2-sharded parameter: refused, pointing to
   the fused stage.
2. attach: one hook per tensor (a parameter, or a module's output through a forward hook),
   chaining the transforms of every rule on it in config order (``chain``).
3. backward: autograd's own; each hook transforms the local gradient before it is
   accumulated into ``.grad`` (and before DDP's all-reduce), in the backward that fills
   ``.grad`` only (``on_filling``: a ``torch.autograd.grad`` inside the loss gets torch's
   gradient, and its penalty's gradient reaches the hooks in that backward); what a chain may leave for
   the end of backward (a deferred chain, ``log`` observations) waits in the stage's
   ``BackwardEnd``; a raw gradient a chain replaced waits in its ``RawLedger`` for the
   non-finite count (``take_raw_parts``).
4. finish: nothing is left after backward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from gradmod.hooks import registry as R
from gradmod.hooks.hook.backward_end import BackwardEnd
from gradmod.hooks.hook.chain import chain_hook, on_filling, output_hook
from gradmod.hooks.hook.ledger import RawLedger
from gradmod.hooks.rules.targets import observer_key
from gradmod.hooks.stage import Core, Stage


class HookStage(Stage):
    name = "hook"
    on_sharded = "use stage: fused (it transforms the reduced, sharded .grad after backward), or a modules: rule on a layer's output"

    def __init__(self, model: nn.Module, targets: list, core: Core):
        self.targets = [t for t in targets if t.stage == self.name]
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self.ledger = RawLedger()  # raw gradients the chains replaced, for the non-finite count
        self.backward_end = BackwardEnd()  # what the chains leave for the end of backward
        params = dict(model.named_parameters())
        modules = dict(model.named_modules())
        # One hook per tensor: its transforms from every rule, chained in config order.
        hooked: dict[str, tuple[Any, list[tuple[str, R.BuiltTransform]]]] = {}
        for t in self.targets:
            hooked.setdefault(t.key, (t, []))[1].extend((t.rule, s) for s in t.steps)
        for key, (t, steps) in hooked.items():
            if t.kind == "param":
                chain = chain_hook(steps, core, key, params[t.name], self.ledger, self.backward_end)
                self._handles.append(params[t.name].register_hook(on_filling(chain, core.fills_grad)))
            else:
                rules = list(dict.fromkeys(rule for rule, _ in steps))
                chain = chain_hook(steps, core, key, None, self.ledger, self.backward_end)
                hook = output_hook(on_filling(chain, core.fills_grad), rules, t.name)
                self._handles.append(modules[t.name].register_forward_hook(hook))

    def records(self) -> list[tuple[str, Any]]:
        return [(observer_key(t, s.fn), s.fn) for t in self.targets for s in t.steps if s.observer]

    def replaced(self) -> set[str]:
        return self.ledger.replaced

    def take_raw_parts(self) -> tuple[list[tuple[str, Tensor]], list[tuple[str, Tensor]], set[str]]:
        return self.ledger.take()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.ledger.take()
        self.backward_end.clear()
